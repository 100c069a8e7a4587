"""Long runs: the same command gives the same records; Ctrl-C stops after the sample in flight and says how to
resume; a full disk or an unwritable results folder is a one-line error that leaves the records whole."""

from __future__ import annotations

import errno
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.errors import ConfigError
from evalkit.records import SAMPLES, read_rows
from tests.conftest import ROOT, compose_config, interrupted, run_cli

TINY = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.0,0.5,1.0]"]


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without what may differ between two runs of one command: timings and the run's random id."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "run_id")} for r in rows]


def test_the_same_command_twice_gives_identical_records(tmp_path):
    args = [*TINY, "variants=[h2o@0.5,random@0.5,snapkv@0.5:chunk48,streaming_llm@64:chunk32]"]
    for name in ("a", "b"):
        result = run_cli(*args, f"hydra.run.dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr
    a, b = (read_rows(tmp_path / name / SAMPLES) for name in ("a", "b"))
    assert len(a) == 3 * 5 and comparable(a) == comparable(b)


def test_ctrl_c_stops_after_the_sample_in_flight_and_the_printed_command_resumes(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "task.samples_per_cell=40", "policy=h2o", f"hydra.run.dir={out}"]
    returncode, err = interrupted(args, out, timeout=120)
    assert returncode == 130, err
    rows = read_rows(out / SAMPLES)
    data = (out / SAMPLES).read_bytes()
    assert data.endswith(b"\n") and len(data.splitlines()) == len(rows)  # whole rows only
    assert 0 < len(rows) < 2 * 120 and len(rows) % 2 == 0  # each sample: its baseline and its variant row
    command = err.split("to resume: ", 1)[1].strip()
    assert command.startswith("python -m evalkit ") and command.endswith("resume=true")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    resumed = subprocess.run(
        [sys.executable, *shlex.split(command)[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    after = read_rows(out / SAMPLES)
    assert len(after) == 2 * 120 and after[: len(rows)] == rows
    assert len({(r["sample_id"], r["variant"]) for r in after}) == len(after)


def test_a_full_disk_is_a_clear_error_and_the_records_stay_whole(tmp_path, monkeypatch):
    from evalkit import records
    from evalkit.cli.job import job_spec, run

    cfg = compose_config(*TINY, "policy=h2o")
    calls = {"n": 0}
    real_fsync = os.fsync

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] > 1:  # the second sample's rows (one write of its baseline and h2o rows) find the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(records.os, "fsync", fsync)
    with pytest.raises(ConfigError, match="No space left on device.*intact.*resume=true"):
        run(*job_spec(cfg, tmp_path))
    data = (tmp_path / SAMPLES).read_bytes()
    # the first sample whole, none of the second (before rows were written one by one: 3, a sample split)
    assert data.endswith(b"\n") and len(read_rows(tmp_path / SAMPLES)) == 2 == len(data.splitlines())
    monkeypatch.setattr(records.os, "fsync", real_fsync)
    cfg.resume = True
    run(*job_spec(cfg, tmp_path))
    assert len(read_rows(tmp_path / SAMPLES)) == 6


@pytest.mark.parametrize("where", ["file-in-the-way", "sysfs"])
def test_an_unwritable_results_folder_is_a_one_line_error(tmp_path, where):
    if where == "sysfs":
        if not Path("/sys/kernel").is_dir():
            pytest.skip("needs Linux sysfs, where nobody, root included, may create folders")
        root = Path("/sys/evalkit-results")
    else:
        (tmp_path / "taken").write_text("a file, not a folder")
        root = tmp_path / "taken" / "results"
    result = run_cli(*TINY, f"results_root={root}")
    assert result.returncode == 2
    assert result.stderr.startswith(f"evalkit: error: cannot write results under {root}")
    assert "results_root=PATH" in result.stderr and "Traceback" not in result.stderr


class TornFile:
    """A file whose next write puts half the row on disk, then finds the disk full."""

    def __init__(self, f):
        self.f = f

    def write(self, data: bytes):
        self.f.flush()
        os.write(self.f.fileno(), data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_torn_write_is_undone_to_the_last_whole_row(tmp_path):
    from evalkit.records import RecordWriter

    path = tmp_path / SAMPLES
    writer = RecordWriter(path)
    writer.write({"a": 1})
    writer._file = TornFile(writer._file)
    with pytest.raises(ConfigError, match="could not write"):
        writer.write({"b": 2, "padding": "x" * 100})
    assert path.read_text() == json.dumps({"a": 1}) + "\n"


class CountingFile:
    """A file that counts the writes it is given."""

    def __init__(self, f):
        self.f, self.writes = f, 0

    def write(self, data):
        self.writes += 1
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_samples_rows_go_to_disk_in_one_write_or_not_at_all(tmp_path):
    """A sample's baseline and variant rows are one write (a worker its launcher kills meanwhile leaves both or
    neither: before, a killed joblib worker could leave the baseline row alone); a write that fails leaves none."""
    from evalkit.records import RecordWriter

    path = tmp_path / SAMPLES
    writer = RecordWriter(path)
    writer._file = counting = CountingFile(writer._file)
    writer.write({"variant": "baseline"}, {"variant": "h2o@0.25"})
    assert counting.writes == 1
    assert path.read_text().splitlines() == [json.dumps({"variant": "baseline"}), json.dumps({"variant": "h2o@0.25"})]
    writer._file = TornFile(counting.f)
    with pytest.raises(ConfigError, match="could not write"):
        writer.write({"variant": "baseline", "padding": "x" * 100}, {"variant": "h2o@0.25"})
    assert len(path.read_text().splitlines()) == 2
