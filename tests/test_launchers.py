"""Sweeps through Hydra's launchers (joblib in parallel here; submitit's local executor through the shipped config,
the Slurm path without a scheduler; the shipped Slurm config composes), merged into one report and one gate; an
interrupted sweep resumes job by job; large-model options on the hf loader."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from evalkit.records import SAMPLES, read_rows
from tests.conftest import ROOT, run_cli

SWEEP = [
    "-m",
    "model=tiny-random",
    "task.context_lengths=[128]",
    "task.depths=[0.0,0.5,1.0]",
    "policy=h2o,streaming_llm",
    "policy.budget=0.25,0.5",
]


def job_folders(sweep) -> dict[str, object]:
    return {str(p.parent.relative_to(sweep)): p.parent for p in sorted(sweep.rglob(SAMPLES))}


def test_joblib_sweep_merges_its_jobs_into_one_report_and_one_gate_and_resumes_job_by_job(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*SWEEP, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}"]
    # tiny-random cannot find needles: the baseline check is off so that the gate judges the policies
    result = run_cli(*args, "gate=default", "gate.min_samples=3", "gate.min_baseline_accuracy=null")
    verdict = json.loads((sweep / "verdict.json").read_text())
    assert result.returncode == {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 2}[verdict["verdict"]], result.stderr
    jobs = job_folders(sweep)
    rest = "task.context_lengths=128,task.depths=0.0,0.5,1.0"  # no brackets in names; no gate options either
    assert sorted(jobs) == [
        f"needle/tiny-random/{p}/policy.budget={b},{rest}" for p in ("h2o", "streaming_llm") for b in (0.25, 0.5)
    ]
    md = (sweep / "report" / "report.md").read_text()
    for name in ("baseline", "h2o@0.25", "h2o@0.5", "streaming_llm@0.25", "streaming_llm@0.5"):
        assert f"| {name} | 3 |" in md  # the baseline that every job repeats is counted once
    assert set(verdict["variants"]) == {"baseline", "h2o@0.25", "h2o@0.5", "streaming_llm@0.25", "streaming_llm@0.5"}

    # An interrupted sweep: one job lost its last row mid-write, one never started; the rest finished.
    done, torn, lost = (jobs[k] for k in sorted(jobs)[:3])
    rows_done = (done / SAMPLES).read_bytes()
    data = (torn / SAMPLES).read_bytes()
    (torn / SAMPLES).write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 1] + b'{"sample_id": "tor')
    for f in lost.iterdir():
        if f.is_file():
            f.unlink()
    result = run_cli(*args, "resume=true")
    assert result.returncode == 0, result.stderr
    assert (done / SAMPLES).read_bytes() == rows_done  # a finished job is not run again
    for job in jobs.values():
        rows = read_rows(job / SAMPLES)
        assert len(rows) == 6 and len({(r["sample_id"], r["variant"]) for r in rows}) == 6
    assert len(json.loads((torn / "run.json").read_text())["resumed"]) == 1


@pytest.mark.parametrize("when", ["workers-starting", "rows-written"])
def test_ctrl_c_stops_a_parallel_sweep_and_prints_how_to_resume_it(tmp_path, when):
    sweep = tmp_path / "sweep"
    args = [*SWEEP, "task.samples_per_cell=40", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "evalkit", *args, f"hydra.sweep.dir={sweep}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches every job
    )
    deadline = time.time() + 120
    if when == "workers-starting":  # the sweep folder exists: Hydra is launching the jobs
        ready = lambda: sweep.exists()  # noqa: E731
    else:
        ready = lambda: any(p.stat().st_size for p in sweep.rglob(SAMPLES))  # noqa: E731
    while not ready() and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "resume=true" in err and f"hydra.sweep.dir={sweep}" in err
    for job in job_folders(sweep).values():
        data = (job / SAMPLES).read_bytes()
        rows = read_rows(job / SAMPLES)
        assert len(rows) % 2 == 0 and len(rows) < 240  # whole samples only, stopped early
        assert not data or data.endswith(b"\n")


def test_a_config_error_in_a_parallel_job_is_one_line(tmp_path):
    args = ["-m", "model=tiny-random", "policy=pyramidkv,h2o", "prefill=chunked", "hydra/launcher=joblib"]
    result = run_cli(*args, "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "evalkit: error: [model=tiny-random policy=pyramidkv prefill=chunked]" in result.stderr


def launcher(name: str):
    with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
        return compose(
            config_name="config", overrides=[f"hydra/launcher={name}"], return_hydra_config=True
        ).hydra.launcher


def test_the_shipped_slurm_launcher_config_composes_on_submitit():
    slurm = launcher("slurm")
    assert slurm._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert slurm.gpus_per_node == 1 and slurm.max_num_timeout == 2 and slurm.timeout_min == 240


def test_the_shipped_local_launcher_is_submitits_and_slurm_is_it_plus_a_partition_and_resources():
    local, slurm = launcher("evalkit_submitit_local"), launcher("slurm")
    assert local._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    assert local.timeout_min == 240  # evalkit's job settings, not the plugin's 60 minutes
    differ = {k for k in local if k != "_target_" and local[k] != slurm[k]}
    assert differ == {"cpus_per_task", "gpus_per_node", "mem_gb"}
    assert "partition" in slurm and "partition" not in local


def submitit_jobs(sweep) -> list[int]:
    """The pids of the submitit job processes running this sweep's jobs."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmd and any(str(sweep).encode() in part for part in cmd):
            pids.append(int(proc.name))
    return pids


def test_submitit_sweep_runs_jobs_resumes_a_killed_one_and_merges(tmp_path):
    """The cluster path on this machine, through the shipped launcher config: two jobs as submitit jobs (pickled,
    each in its own process and log folder); one is killed while it writes rows; the sweep says so in one line (exit 2)
    with the command that resumes it; the resumed sweep finishes that job only and merges both into one report and
    one verdict, as the joblib path does."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "model=tiny-random",
        "task.context_lengths=[128]",
        "task.depths=[0.0,1.0]",
        "task.samples_per_cell=8",
        "task.max_new_tokens=4",
        "policy=h2o,streaming_llm",
        "policy.budget=0.25",
        "hydra/launcher=evalkit_submitit_local",
        f"hydra.sweep.dir={sweep}",
        "gate=default",
        "gate.min_samples=3",
        "gate.min_baseline_accuracy=null",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "evalkit", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.time() + 300
    while not (writing := [p for p in sweep.rglob(SAMPLES) if p.stat().st_size]) and time.time() < deadline:
        time.sleep(0.05)
    jobs_running = submitit_jobs(sweep)
    assert len(jobs_running) == 2, "each job runs in a submitit process of its own"
    victim = json.loads((writing[0].parent / ".evalkit.lock").read_text())["pid"]  # the job writing rows
    assert victim in jobs_running
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    err = err.decode()
    assert proc.returncode == 2, err
    assert "Traceback" not in err and "a sweep job did not finish" in err
    assert f"to resume: python -m evalkit {shlex.join(args)} resume=true" in err
    assert len([p for p in (sweep / ".submitit").iterdir() if p.name != "%j"]) == 2  # two jobs, their logs apart
    jobs = job_folders(sweep)
    assert len(jobs) == 2
    done = {name: len(read_rows(job / SAMPLES)) for name, job in jobs.items()}
    assert sorted(done.values())[0] < 32 == sorted(done.values())[1]  # the killed job stopped early, whole rows
    killed = next(name for name, n in done.items() if n < 32)
    kept = {name: (job / SAMPLES).read_bytes() for name, job in jobs.items()}

    result = subprocess.run(
        [sys.executable, "-m", "evalkit", *args, "resume=true"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    verdict = json.loads((sweep / "verdict.json").read_text())
    assert result.returncode == {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 2}[verdict["verdict"]], result.stderr
    for name, job in jobs.items():
        rows = read_rows(job / SAMPLES)
        assert len(rows) == 32 and len({(r["sample_id"], r["variant"]) for r in rows}) == 32
        assert (job / SAMPLES).read_bytes().startswith(kept[name])  # what was written stays, the rest appended
    info = json.loads((jobs[killed] / "run.json").read_text())
    assert len(info["resumed"]) == 1
    assert set(verdict["variants"]) == {"baseline", "h2o@0.25", "streaming_llm@0.25"}
    md = (sweep / "report" / "report.md").read_text()
    for name in ("baseline", "h2o@0.25", "streaming_llm@0.25"):
        assert f"| {name} | 16 |" in md  # the baseline that both jobs repeat is counted once


@pytest.fixture(scope="module")
def saved_tiny(tiny, tmp_path_factory):
    """The tiny model saved as a Hugging Face folder, loaded back through model=hf."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


def test_hf_model_with_device_map_auto_in_bfloat16(saved_tiny, tmp_path):
    args = ["model=hf", f"model.name_or_path={saved_tiny}", "model.device_map=auto", "model.dtype=bfloat16"]
    result = run_cli(*args, "task.context_lengths=[128]", "task.depths=[0.5]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run.json").read_text())["model"]["dtype"] == "bfloat16"
    base = next(r for r in read_rows(tmp_path / SAMPLES) if r["variant"] == "baseline")
    cfg = json.loads((saved_tiny / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # keys+values, bf16
    assert base["kv_bytes"] == base["context_tokens"] * per_token


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where flash attention cannot run")
def test_flash_attention_where_it_cannot_run_is_a_one_line_error(saved_tiny):
    result = run_cli("model=hf", f"model.name_or_path={saved_tiny}", "model.attn_implementation=flash_attention_2")
    assert result.returncode == 2 and "flash_attention_2" in result.stderr and "sdpa" in result.stderr
    assert "Traceback" not in result.stderr
