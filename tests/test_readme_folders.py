"""README.md's folders against the folders its commands write, so the two cannot drift apart.

Every `python -m evalkit ...` command of the README is composed as Hydra composes it (conf/config.yaml and its
folder resolvers, registered as the command line registers them), and its run folder read from the composed
`hydra.run.dir` (a sweep: `hydra.sweep.dir` and each job's `hydra.sweep.subdir`): the code's own folder rule, run
dry. `--out`, lm-eval's `records=` and the planner's output folder are written too. Then:

- every run folder a gate, report, planner (`plan.runs=[...]`) or `wandb sync` command names is one of those folders,
  or a folder holding some (a sweep's);
- every concrete `results/...` path the README shows anywhere (prose, console output), and every folder its console
  output says evalkit wrote into (`evalkit: wrote PATH`), lies on the path of one of them (the folder, a folder
  holding it, or a file in it); a path with a placeholder (`<run>`, `RUN`, `MODEL`) is skipped.

The README's row of its policy example shows every field a row records of that policy.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import PurePosixPath

import pytest
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from evalkit.cli.config import policy_from
from evalkit.cli.main import register_resolvers
from evalkit.kv.variant import policy_record
from tests.conftest import importable
from tests.test_docs import COMMANDS, README, combinations, fenced_blocks, policy_example

RUNNING = ("--cfg", "-c", "--help", "-h", "--info", "-i")
PLACEHOLDER = re.compile(r"<|^[A-Z][A-Z0-9_]*$")
PATH = re.compile(r"results/[^\s`'\")\]]*")


@pytest.fixture(scope="module")
def my_conf(tmp_path_factory):
    """The README's policy example (my_policies.py, my_conf/policy/vnorm.yaml), for the commands that name it."""
    return policy_example(tmp_path_factory.mktemp("readme-folders"))


def run_folders(argv: list[str]) -> list[PurePosixPath]:
    """The folders `python -m evalkit ARGV` writes, from its composed config (nothing run)."""
    register_resolvers()
    sweep = "-m" in argv or "--multirun" in argv
    out = []
    for job in combinations(argv):
        job = [a for a in job if not a.startswith("-")]
        with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=job, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        if sweep:
            out += [PurePosixPath(cfg.hydra.sweep.dir), PurePosixPath(cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir)]
        else:
            out.append(PurePosixPath(cfg.hydra.run.dir))
    return out


def written_folders() -> set[PurePosixPath]:
    """Every folder a README command writes: run and sweep folders, `--out DIR`, lm-eval's `records=DIR`, and the
    planner's output folder (its own rule: plan.out, else RESULTS_ROOT/plan/MODEL)."""
    out: set[PurePosixPath] = set()
    for module, *argv in COMMANDS:
        if any(a in RUNNING for a in argv):
            continue
        if module == "evalkit":
            out.update(run_folders(argv))
        out.update(PurePosixPath(b) for a, b in zip(argv, argv[1:], strict=False) if a == "--out")
        out.update(PurePosixPath(m) for a in argv for m in re.findall(r"records=([^,\s]+)", a))
        if module == "evalkit.plan":
            with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
                cfg = compose(config_name="plan", overrides=argv)
            out.add(PurePosixPath(cfg.plan.out or f"{cfg.results_root}/plan/{cfg.model.name}"))
    return out


def read_folders() -> list[tuple[str, str]]:
    """(command, folder) for every run folder a README command reads: the gate's and the report's folders, the
    planner's `plan.runs`, and what `wandb sync` uploads (the run folder above its `wandb/`)."""
    out = []
    for module, *argv in COMMANDS:
        if module in ("evalkit.gate", "evalkit.report"):
            options = ("--out", "--junit", "--summary")  # what follows them is written, not read
            given = [b for a, b in zip(["", *argv], argv, strict=False) if a not in options and "/" in b]
            given = [b for b in given if not b.startswith("-")]
            out += [(f"{module} {shlex.join(argv)}", f) for f in given]
        for a in argv:
            if a.startswith("plan.runs="):
                out += [(f"{module} {a}", f) for f in a.partition("=")[2].strip("[]").split(",")]
    for _, body in fenced_blocks(README):
        for line in body.splitlines():
            if line.startswith("wandb sync "):
                out += [(line, p.partition("/wandb/")[0]) for p in shlex.split(line, comments=True)[2:]]
    return out


def concrete(path: str) -> bool:
    return not any(PLACEHOLDER.search(part) for part in PurePosixPath(path).parts)


def on_the_path(path: PurePosixPath, folder: PurePosixPath) -> bool:
    return path == folder or path in folder.parents or folder in path.parents


@pytest.fixture(scope="module")
def written(my_conf) -> set[PurePosixPath]:
    """written_folders(), composed from the folder the README's policy example runs in (`file://my_conf`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(my_conf)
        return written_folders()


def test_the_readme_commands_write_the_folders_it_names(written):
    """The rule is applied, not assumed: the quick start's run writes the folder the README shows it writing, a
    sweep's job the folder under the sweep's, and the middoc run its folder without its sample count."""
    assert PurePosixPath("results/needle/smollm2-135m/h2o/default") in written
    assert PurePosixPath("results/sweeps/h2o-vs-streaming/needle/smollm2-135m/h2o/policy.budget=0.25") in written
    assert PurePosixPath("results/middoc/smollm2-135m/snapkv/policy.budget=0.5") in written


@pytest.mark.parametrize(("command", "folder"), [r for r in read_folders() if concrete(r[1])], ids=lambda x: x[:70])
def test_every_folder_a_command_reads_is_one_a_readme_command_writes(written, command, folder):
    path = PurePosixPath(folder.rstrip("/"))
    near = sorted(str(w) for w in written if w.parts[:2] == path.parts[:2])
    assert any(path == w or path in w.parents for w in written), (
        f"{command}: {folder} is written by no README command; beside it they write {near}"
    )


def test_every_concrete_results_path_in_the_readme_is_on_a_written_folders_path(written):
    shown = {p.rstrip("/.") for p in PATH.findall(README) if concrete(p) and "*" not in p}
    shown |= {str(PurePosixPath(p).parent) for p in re.findall(r"^evalkit: wrote (\S+)$", README, flags=re.M)}
    stray = sorted(p for p in shown if not any(on_the_path(PurePosixPath(p), w) for w in written))
    assert not stray, f"README paths no README command writes: {stray}"


def test_the_readme_row_shows_every_field_the_policy_records(my_conf, monkeypatch):
    importable(monkeypatch, my_conf, "my_policies")
    block = next(b for info, b in fenced_blocks(README) if info == "json" and '"variant": "vnorm@0.25"' in b)
    shown = json.loads(re.search(r'"policy": (\{.*?\})', block, flags=re.S).group(1))
    built = policy_from(OmegaConf.load(my_conf / "my_conf" / "policy" / "vnorm.yaml"))
    assert shown == json.loads(json.dumps(policy_record(built)))
