"""A sweep on the console and on the cores: each launcher's jobs say on the launching console, one line each, when
they finish and with what figures (submitit's jobs print only into their logs), and the jobs that run at once split
the cores (torch threads = cores // jobs at once, at least 1) instead of each taking all of them."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest

from evalkit.cli.cores import job_threads, sweep_size
from evalkit.cli.progress import Progress
from evalkit.records import SAMPLES
from tests.conftest import ROOT, run_cli

JOBLIB = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": -1}
SUBMITIT = {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"}
BASIC = {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}
SLURM = {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"}
SWEEP = [
    "-m",
    "model=tiny-random",
    "task.context_lengths=[128]",
    "task.depths=[0.5]",
    "task.samples_per_cell=2",
    "task.max_new_tokens=4",
    "policy=h2o,streaming_llm",
    "policy.budget=0.5",
]
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize(
    ("launcher", "jobs", "cores", "threads"),
    [
        ({**JOBLIB, "n_jobs": 2}, 4, 16, 8),  # two at a time
        (JOBLIB, 4, 16, 4),  # n_jobs=-1: every core a worker, but only 4 jobs
        ({**JOBLIB, "n_jobs": -2}, 100, 16, 1),  # joblib's rule: 16 + 1 - 2 = 15 workers
        (SUBMITIT, 3, 16, 5),  # submitit's local executor starts every job at once
        (SUBMITIT, None, 16, 1),  # how many unknown: as many as the cores
        ({**JOBLIB, "n_jobs": 8}, 2, 3, 1),  # at least one thread
        (BASIC, 6, 16, 16),  # one job at a time, all the cores
        (SLURM, 6, 16, None),  # each job on its own allocation: torch's own choice
    ],
)
def test_the_cores_are_split_between_the_jobs_that_run_at_once(monkeypatch, launcher, jobs, cores, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert job_threads(launcher, jobs, cores) == threads


def test_a_users_omp_num_threads_is_the_most_a_job_gets(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert job_threads(BASIC, 1, 16) == 2
    assert job_threads(SUBMITIT, 16, 16) == 1


def test_a_sweep_is_counted_as_the_product_of_its_values():
    assert sweep_size(["policy=h2o,snapkv", "policy.budget=0.25,0.5,0.75", "task=needle"]) == 6
    assert sweep_size(["policy=h2o", "task.depths=[0.25,0.5]"]) == 1  # a list is one value
    assert sweep_size(["policy=glob(*)"]) is None  # needs the config to count


def done_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"evalkit: job \d+/2 done \(\d+ s\): ", line)]


def check_jobs(sweep, stdout: str, threads: int) -> None:
    """Each job: one line naming its folder and its variant's accuracy beside the baseline's, as its summary.json
    says; its run.json records the threads it ran on."""
    lines = done_lines(stdout)
    folders = sorted(p.parent for p in sweep.rglob(SAMPLES))
    assert len(folders) == 2 and len(lines) == 2, stdout
    assert sorted(int(re.match(r"evalkit: job (\d)", line).group(1)) for line in lines) == [1, 2]
    for folder in folders:
        (line,) = [line for line in lines if f": {folder.relative_to(sweep)}: " in line]
        summary = json.loads((folder / "summary.json").read_text())
        (name,) = [k for k in summary if k != "baseline"]
        v = summary[name]
        assert f"{name} {v['accuracy']:.2f} vs baseline {v['baseline_accuracy']:.2f} (lost {v['lost']}," in line
        assert json.loads((folder / "run.json").read_text())["torch_threads"] == threads


def test_a_joblib_sweep_says_each_job_as_it_finishes_and_splits_the_cores(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        *SWEEP, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}",
        env={"OMP_NUM_THREADS": str(CORES)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    check_jobs(sweep, result.stdout, max(1, CORES // 2))


def test_the_basic_launcher_says_each_job_and_gives_it_every_core(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(*SWEEP, f"hydra.sweep.dir={sweep}", env={"OMP_NUM_THREADS": str(CORES)})
    assert result.returncode == 0, result.stderr[-2000:]
    check_jobs(sweep, result.stdout, CORES)


def test_a_submitit_local_sweep_prints_each_job_on_the_console_not_only_in_its_log(tmp_path):
    """submitit's local executor, by the plugin's own config name as a user writes it: its jobs print into
    .submitit/<id>/*_log.out; the launching console still gets one line per job, and the jobs split the cores."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(CORES)}
    result = subprocess.run(
        [sys.executable, "-m", "evalkit", *SWEEP, "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    check_jobs(sweep, result.stdout, max(1, CORES // 2))


def test_a_resumed_sweep_says_only_the_jobs_finished_in_this_run(tmp_path):
    """A summary.json already there when the sweep starts (resume=true) is an earlier run's: not said again; one
    rewritten since, and a new one, are; each once, however often the folder is looked at."""
    summary = {"baseline": {"accuracy": 1.0}, "h2o@0.25": {"accuracy": 0.5, "baseline_accuracy": 1.0, "lost": 1,
                                                           "gained": 0, "n": 2}}  # fmt: skip
    old, rerun, new = (tmp_path / name for name in ("a", "b", "c"))
    for folder in (old, rerun):
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(summary))
    out = io.StringIO()
    progress = Progress(tmp_path, 3, out)
    new.mkdir()
    (new / "summary.json").write_text(json.dumps(summary))
    (rerun / "summary.json").write_text(json.dumps(summary))
    os.utime(rerun / "summary.json", ns=(1, 1))  # rewritten: another modification time
    progress.poll()
    progress.poll()
    lines = out.getvalue().splitlines()
    assert [line.split(" done ")[0] for line in lines] == ["evalkit: job 1/3", "evalkit: job 2/3"]
    assert [line.split(": ")[2] for line in lines] == ["b", "c"]
    assert all(line.endswith(": h2o@0.25 0.50 vs baseline 1.00 (lost 1, gained 0, n 2)") for line in lines)
