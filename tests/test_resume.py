"""A killed run loses at most the row in flight; resume=true finishes it without repeating a row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from evalkit.records import read_rows
from tests.conftest import ROOT, run_cli

ARGS = [
    "model=tiny-random",
    "model.config.num_hidden_layers=6",
    "model.config.hidden_size=256",
    "model.config.intermediate_size=512",
    "model.config.head_dim=64",
    "task.context_lengths=[512,1024]",
    "task.depths=[0.0,0.25,0.5,0.75,1.0]",
    "task.samples_per_cell=2",
]
TOTAL_ROWS = 2 * 5 * 2 * 2  # lengths x depths x samples x (baseline + policy)


def keyed(rows):
    return {(r["sample_id"], r["variant"]): (r["prediction"], r["score"], r["kv_bytes"]) for r in rows}


def test_killed_run_resumes_where_it_stopped(tmp_path):
    out = tmp_path / "run"
    rows_path = out / "samples.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "evalkit", *ARGS, f"hydra.run.dir={out}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if rows_path.exists() and rows_path.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    written = rows_path.read_bytes()
    complete = written[: written.rfind(b"\n") + 1]
    assert 5 <= complete.count(b"\n") < TOTAL_ROWS, "the run should have been killed part-way"

    again = run_cli(*ARGS, f"hydra.run.dir={out}")
    assert again.returncode == 2 and "add resume=true" in again.stderr
    assert rows_path.read_bytes() == written, "a refused rerun must not touch the records"

    resumed = run_cli(*ARGS, f"hydra.run.dir={out}", "resume=true")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stdout
    final = rows_path.read_bytes()
    assert final.startswith(complete), "rows written before the kill are kept as they were"
    rows = read_rows(rows_path)
    assert len(rows) == TOTAL_ROWS == len(keyed(rows))

    clean = run_cli(*ARGS, f"hydra.run.dir={tmp_path / 'clean'}")
    assert clean.returncode == 0, clean.stderr
    assert keyed(read_rows(tmp_path / "clean" / "samples.jsonl")) == keyed(rows)


def test_torn_last_line_is_cut_on_resume(tmp_path):
    """The uninterrupted run is the expectation: after a torn last row and a resume, the file holds the same rows,
    per (sample, variant), in the same order, none repeated and none lost, with the same content (all but the run's
    id and timings); the rows before the torn one are kept byte for byte."""
    args = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.0,1.0]", f"hydra.run.dir={tmp_path}"]
    assert run_cli(*args).returncode == 0
    rows_path = tmp_path / "samples.jsonl"
    lines = rows_path.read_bytes().splitlines(keepends=True)
    uninterrupted = [json.loads(x) for x in lines]
    # 2 samples (depths 0 and 1) x (baseline + the default policy), in the order the run writes them
    assert [r["variant"] for r in uninterrupted] == ["baseline", "streaming_llm@0.25"] * 2
    assert len({r["sample_id"] for r in uninterrupted}) == 2
    rows_path.write_bytes(b"".join(lines[:-1]) + lines[-1][:40])  # as if killed while writing the last row
    result = run_cli(*args, "resume=true")
    assert result.returncode == 0, result.stderr
    final = rows_path.read_bytes().splitlines(keepends=True)
    assert final[:-1] == lines[:-1], "the complete rows are kept as they were"
    resumed = [json.loads(x) for x in final]
    key = [(r["sample_id"], r["variant"]) for r in uninterrupted]
    assert [(r["sample_id"], r["variant"]) for r in resumed] == key

    def content(row):
        return {k: v for k, v in row.items() if k not in ("run_id", "seconds")}

    assert [content(r) for r in resumed] == [content(r) for r in uninterrupted]


def test_resume_refuses_a_different_config(tmp_path):
    args = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", f"hydra.run.dir={tmp_path}"]
    assert run_cli(*args).returncode == 0
    result = run_cli(*args, "policy.budget=0.5", "resume=true")
    assert result.returncode == 2
    assert "policy.budget: 0.25 -> 0.5" in result.stderr
    assert os.path.getsize(tmp_path / "samples.jsonl") > 0


def test_a_consistent_forgery_is_caught_by_rescoring_on_resume(tmp_path):
    """A sample's baseline row and its variant row edited together (score 1 on both, baseline_score 1, no flip): no
    row contradicts another, yet the prediction does not contain the answer. Extending the run re-scores every row
    written from its prediction with the task's scorer, and stops at the first edited line."""
    from evalkit.cli.job import job_spec, run
    from evalkit.errors import ConfigError
    from tests.conftest import compose_config

    args = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.0,1.0]", "policy.budget=0.5"]
    out = tmp_path / "run"
    run(*job_spec(compose_config(*args, "task.samples_per_cell=1"), out))
    path = out / "samples.jsonl"
    rows = [dict(r) for r in read_rows(path)]  # as the file holds them, to edit
    assert all(r["score"] == 0.0 for r in rows)  # the random model finds no needle
    for r in rows[:2]:  # lines 1 and 2: sample L128-d0.0-0, its baseline and its policy row
        r["score"] = r["baseline_score"] = 1.0
        r["flip"] = None
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        run(*job_spec(compose_config(*args, "task.samples_per_cell=2", "resume=true"), out))
    except ConfigError as err:
        message = str(err)
    else:
        raise AssertionError("the forged rows were carried into the extended run")
    assert f"{path}:1: score=1.0, but its prediction" in message and "scores 0.0" in message
    assert len(read_rows(path)) == 4  # nothing written
