"""A regular (non-editable) install carries conf/, policies/ and kernels/ inside evalkit, every folder of the package
(the calibration tools, `python -m evalkit.calibrate`, among them), and runs anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

CALIBRATE = ("qfilter", "kvzap", "fastkvzip", "lukv", "ea_stats", "restorekv")


def test_every_folder_of_the_package_is_listed_in_pyproject():
    """setuptools installs the packages pyproject.toml lists, no others: a folder left out is missing from the wheel
    (and from `pip install evalkit`) while an editable install still finds it. Every folder holding files, under each
    folder package-dir maps, must be listed (data folders too: setuptools warns about those it is not told of)."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    wanted = set()
    for package, folder in setuptools["package-dir"].items():
        top = ROOT / folder
        for path in [top, *top.rglob("*")]:
            if path.is_dir() and "__pycache__" not in path.parts and any(f.is_file() for f in path.iterdir()):
                wanted.add(".".join([package, *path.relative_to(top).parts]))
    assert sorted(wanted - set(setuptools["packages"])) == []


def test_wheel_ships_conf_policies_and_kernels_inside_evalkit_and_runs_outside_the_tree(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("evalkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for required in [
        "evalkit/conf/config.yaml",
        "evalkit/conf/policy/streaming_llm.yaml",
        "evalkit/conf/model/smollm2-135m.yaml",
        "evalkit/policies/streaming_llm.py",
        "evalkit/kernels/__init__.py",
        "evalkit/tasks/needle.py",
        "evalkit/templates/base.html.j2",  # the report's and the plan's pages (package data)
        "evalkit/templates/report.html.j2",
        "evalkit/templates/plan.html.j2",
        "evalkit/templates/macros.html.j2",
        "evalkit/engine/engine.py",
        "evalkit/contract/__init__.py",
        "evalkit/config/choices.py",
        "evalkit/stats/__init__.py",
        "evalkit/calibrate/__main__.py",
        "evalkit/calibrate/main.py",
        "evalkit/calibrate/common.py",
        *(f"evalkit/calibrate/{tool}.py" for tool in CALIBRATE),
    ]:
        assert required in names
    assert not [n for n in names if n.split("/")[0] in ("policies", "kernels", "conf")]

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run(
        [sys.executable, "-c", "import evalkit.policies, evalkit.kernels; print(evalkit.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.stdout.startswith(str(site)), probe.stdout + probe.stderr
    run = subprocess.run(
        [sys.executable, "-m", "evalkit", "model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    tools = subprocess.run(
        [sys.executable, "-m", "evalkit.calibrate", "--help"], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert tools.returncode == 0, tools.stderr[-2000:]
    assert [line.split()[0] for line in tools.stdout.splitlines() if line.startswith("    ")] == list(CALIBRATE)
    (folder,) = [p.parent for p in elsewhere.glob("results/needle/tiny-random/streaming_llm/*/samples.jsonl")]
    page = subprocess.run(
        [sys.executable, "-m", "evalkit.report", str(folder)], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert page.returncode == 0 and (folder / "report" / "report.html").is_file(), page.stderr[-2000:]
