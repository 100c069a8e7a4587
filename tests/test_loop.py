"""The one sample loop (evalkit.run.loop) on the engines whose Ctrl-C and resume were not yet tested through it:
llama.cpp in-process (Ctrl-C stops after the sample in flight, resume=true finishes the run with no row written
twice) and lm-eval's driver (resume=true writes only the missing rows). evalkit's engine: tests/test_reliability.py
and tests/test_resume.py; an OpenAI-compatible server: tests/test_backend_engines.py; the lock, taken before any
engine is chosen: tests/test_run_integrity.py."""

from __future__ import annotations

import json

import pytest

from evalkit.records import SAMPLES, read_rows
from tests.conftest import LLAMACPP, NEEDS_LLAMA, interrupted, run_cli

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def keys(rows: list[dict]) -> list[tuple[str, str]]:
    return [(r["sample_id"], r["variant"]) for r in rows]


@pytest.mark.real_model
@NEEDS_LLAMA
def test_llamacpp_ctrl_c_stops_after_the_sample_in_flight_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    args = [*LLAMACPP, "variants=[llamacpp:q4_0]", "task=needle", "task.context_lengths=[128]"]
    args += ["task.depths=[0.25,0.75]", "task.samples_per_cell=2", f"hydra.run.dir={out}"]  # 4 samples
    returncode, err = interrupted(args, out, timeout=300)
    assert returncode == 130, err[-3000:]
    rows = read_rows(out / SAMPLES)
    data = (out / SAMPLES).read_bytes()
    assert data.endswith(b"\n") and len(data.splitlines()) == len(rows)  # whole rows only
    assert 0 < len(rows) < 2 * 4 and len(rows) % 2 == 0  # each sample: its baseline and its variant row
    assert "samples left to run" in err and err.rstrip().endswith("resume=true")
    resumed = run_cli(*args, "resume=true", process=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{len(rows) // 2} of 4 samples already done" in resumed.stdout
    after = read_rows(out / SAMPLES)
    assert after[: len(rows)] == rows  # the rows written before are kept as they were
    assert len(set(keys(after))) == len(after) == 2 * 4
    assert len(json.loads((out / "run.json").read_text())["resumed"]) == 1


def test_lm_eval_resume_writes_only_the_missing_rows(tmp_path):
    """lm-eval runs every request again (it has no sample to skip), and the loop writes only the rows missing: a
    document's variant row lost to a kill comes back, the rows before stay as they were."""
    args = ["model=tiny-random", "task=lm_eval", "task.limit=3", "variants=[snapkv@0.5]", f"hydra.run.dir={tmp_path}"]
    first = run_cli(*args, env=OFFLINE)
    assert first.returncode == 0, first.stderr[-3000:]
    path = tmp_path / SAMPLES
    kept = path.read_text().splitlines(keepends=True)[:-1]  # killed before the last document's variant row
    path.write_text("".join(kept))
    second = run_cli(*args, "resume=true", env=OFFLINE)
    assert second.returncode == 0, second.stderr[-3000:]
    lines = path.read_text().splitlines(keepends=True)
    assert lines[: len(kept)] == kept and len(lines) == len(kept) + 1
    expected = [(f"evalkit_recall/{i}", v) for i in range(3) for v in ("baseline", "snapkv@0.5")]
    assert sorted(keys(read_rows(path))) == sorted(expected)
    assert len(json.loads((tmp_path / "run.json").read_text())["resumed"]) == 1
