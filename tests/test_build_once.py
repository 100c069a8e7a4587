"""Each object a command names is built once: the pre-check's task and policies are the ones its job runs (never
built again), and each policy is prepared once per command, task=lm_eval included."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import importable, run_cli

MODULE = """
from dataclasses import dataclass

from evalkit.policies.snapkv import SnapKV
from evalkit.tasks.needle import NeedleTask

BUILT = []  # a name per CountedNeedle built
PREPARED = []  # the budget of each CountedSnapKV, per prepare


@dataclass(kw_only=True)
class CountedNeedle(NeedleTask):
    def __post_init__(self):
        BUILT.append(self.name)


@dataclass(kw_only=True)
class CountedSnapKV(SnapKV):
    def prepare(self, model, probes):
        PREPARED.append(self.budget)
        return None
"""

TINY = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", "task.samples_per_cell=1"]


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """The module my_counted (CountedNeedle, CountedSnapKV and their counts), importable here as the commands run
    in this process; the overrides that make a command's task and policy the counted ones."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "my_counted.py").write_text(textwrap.dedent(MODULE))
    importable(monkeypatch, src, "my_counted")
    import my_counted

    return my_counted, ["policy=snapkv", "policy._target_=my_counted.CountedSnapKV", "policy.window=8"]


def variants_run(folder: Path) -> set[str]:
    return {json.loads(line)["variant"] for line in (folder / "samples.jsonl").read_text().splitlines()}


def test_a_command_builds_its_task_once_and_prepares_each_policy_once(counted, tmp_path):
    """The pre-check builds the task and the policy; the job runs those. Before, the job built them again: two
    CountedNeedle per command."""
    module, policy = counted
    result = run_cli(*TINY, "task._target_=my_counted.CountedNeedle", *policy, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert module.BUILT == ["needle"]
    assert module.PREPARED == [0.25]
    assert variants_run(tmp_path) == {"baseline", "CountedSnapKV[snapkv]@0.25"}


def test_each_job_of_a_sweep_runs_the_parts_the_pre_check_built_for_it(counted, tmp_path):
    """A sweep of two budgets: the pre-check builds both jobs' parts, each job runs its own (the budget it names),
    none built again. Before, four CountedNeedle for two jobs."""
    module, policy = counted
    result = run_cli(
        "-m", *TINY, "task._target_=my_counted.CountedNeedle", *policy, "policy.budget=0.25,0.5",
        f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert module.BUILT == ["needle", "needle"]
    assert sorted(module.PREPARED) == [0.25, 0.5]
    ran = sorted(sorted(variants_run(rows.parent) - {"baseline"}) for rows in tmp_path.rglob("samples.jsonl"))
    assert ran == [["CountedSnapKV[snapkv]@0.25"], ["CountedSnapKV[snapkv]@0.5"]]


def test_task_lm_eval_prepares_each_policy_once(counted, tmp_path, monkeypatch):
    """task=lm_eval: the engine prepares the policy as the model loads, and lm-eval's model (EvalkitLM) takes it
    prepared. Before, EvalkitLM prepared it again: two prepares per policy."""
    pytest.importorskip("lm_eval", reason="pip install 'lm-eval>=0.4.9,<0.5' for the lm-eval integration")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module, policy = counted
    result = run_cli(
        "model=tiny-random", "task=lm_eval", "task.limit=2", *policy, "policy.budget=0.5", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert module.PREPARED == [0.5]
    assert variants_run(tmp_path) == {"baseline", "CountedSnapKV[snapkv]@0.5"}
