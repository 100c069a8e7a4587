"""A regular (non-editable) install carries conf/, policies/ and kernels/ inside evalkit and runs anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from tests.conftest import ROOT


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
    (folder,) = [p.parent for p in elsewhere.glob("results/needle/tiny-random/streaming_llm/*/samples.jsonl")]
    page = subprocess.run(
        [sys.executable, "-m", "evalkit.report", str(folder)], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert page.returncode == 0 and (folder / "report" / "report.html").is_file(), page.stderr[-2000:]
