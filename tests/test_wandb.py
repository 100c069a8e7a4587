"""W&B as its users compare experiments, read back from the offline run files W&B wrote (no mock of wandb): a run per
(evalkit run, variant) with its config and summary fields, its per-sample table, the report page and the run's files
as an artifact; `python -m evalkit.gate --wandb` adds the verdict to the very same runs."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from evalkit.cli.gate import main as gate_main
from evalkit.records.summary import summarize
from evalkit.records.verdict import label_of
from tests.conftest import as_rows, run_cli
from tests.test_gate import run_info
from tests.test_report import needle_rows, write_run

DEFAULT = {"max_drop": 0.05, "confidence": 0.95}  # what the run was gated with, as the command line hands it on


def run_id(local: Path) -> str:
    """The run id in the name of W&B's offline folder, offline-run-TIME-ID, or offline-run-TIME-ID-N where a run of
    the same id started in the same second (W&B's set_sync_dir_suffix)."""
    return local.name.split("-")[3]


def wandb_records(path):
    """The records of an offline W&B run file: a 7-byte header, then LevelDB-style log blocks of protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            return
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_back(local) -> dict:
    """One offline W&B run as written: id, group, name, config, summary, artifacts (name: files) and media files."""
    (log,) = local.glob("run-*.wandb")
    deadline = time.time() + 60  # W&B's writer process may still be flushing the file when finish() returns
    while time.time() < deadline and "exit" not in {r.WhichOneof("record_type") for r in wandb_records(log)}:
        time.sleep(0.5)
    out = {"config": {}, "summary": {}, "artifacts": {}, "folder": local}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out |= {"id": record.run.run_id, "group": record.run.run_group, "name": record.run.display_name}
            out["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        if kind == "summary":
            out["summary"].update({u.key: json.loads(u.value_json) for u in record.summary.update if u.key})
        if kind == "artifact":
            out["artifacts"][record.artifact.name] = {m.path for m in record.artifact.manifest.contents}
    return out


@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("wandb", reason="pip install wandb for logger=wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_a_run_per_variant_with_config_summary_table_page_and_artifact_then_the_gates_verdict(tmp_path, offline):
    from evalkit.report.wandb_log import log_run

    recs = needle_rows()  # baseline 12/12; streaming_llm@0.25 loses 4 of 12 at a quarter of the bytes; snapkv@0.5 none
    run_dir = write_run(tmp_path / "run", recs, run_info("r1"))
    assert gate_main([str(run_dir)]) == 2  # 12 samples: INCONCLUSIVE; verdict.json is written before W&B logs
    verdict = json.loads((run_dir / "verdict.json").read_text())
    logged = [read_back(p) for p in log_run(run_dir, "evalkit", entity=None, mode="offline", thresholds=DEFAULT)]

    runs = {r["config"]["variant"]: r for r in logged}
    assert sorted(runs) == ["baseline", "snapkv@0.5", "streaming_llm@0.25"]  # a W&B run each, the baseline included
    assert len({r["id"] for r in logged}) == 3 and {r["group"] for r in logged} == {"needle"}  # the task's name
    s = runs["streaming_llm@0.25"]
    assert s["name"] == "run/streaming_llm@0.25"
    assert {k: s["config"][k] for k in ("task", "model", "backend", "policy", "budget", "quantization", "prefill")} == {
        "task": "needle",
        "model": "m",
        "backend": "hf",
        "policy": "streaming_llm",
        "budget": 0.25,
        "quantization": "none",
        "prefill": "oneshot",
    }
    assert s["config"]["gate"] == DEFAULT and runs["baseline"]["config"]["policy"] == "baseline"
    summary = s["summary"]
    assert summary["accuracy"] == pytest.approx(8 / 12) and summary["baseline_accuracy"] == 1.0
    assert summary["drop"] == pytest.approx(4 / 12) and (summary["lost"], summary["gained"]) == (4, 0)
    assert summary["drop_lower"] < 4 / 12 < summary["drop_upper"] <= 1
    assert summary["kv_ratio_measured"] == pytest.approx(25 / 100) and summary["kv_bytes_are"] == "measured"
    assert runs["snapkv@0.5"]["summary"]["kv_ratio_measured"] == pytest.approx(50 / 100)
    # the gate judged after the last row: its verdict, this variant's status and only this variant's reasons
    assert summary["verdict"] == "INCONCLUSIVE" == summary["gate_status"]
    assert summary["gate_reasons"] and all(r.startswith("streaming_llm@0.25: ") for r in summary["gate_reasons"])
    assert len(summary["gate_reasons"]) == sum(r.startswith("streaming_llm@0.25: ") for r in verdict["reasons"])
    for variant, r in runs.items():
        (table,) = (r["folder"] / "files" / "media" / "table").glob("samples_*.table.json")
        data = json.loads(table.read_text())["data"]
        assert len(data) == sum(x["variant"] == variant for x in recs) == 12  # this variant's rows only
        (page,) = (r["folder"] / "files" / "media" / "html").glob("report_*.html")
        assert "tradeoff-plot" in page.read_text()  # the report page, its Plotly figures interactive
        assert r["artifacts"]["evalkit-r1"] == {"samples.jsonl", "verdict.json", "report.html"}

    # a later gate with --wandb: the W&B runs it writes to are the same ones, found again by their derived ids
    assert gate_main([str(run_dir), "--wandb", "--gate", "default"]) == 2
    by_id = defaultdict(list)
    for local in sorted((run_dir / "wandb").glob("offline-run-*")):
        by_id[run_id(local)].append(local)
    assert set(by_id) == {r["id"] for r in logged} and all(len(v) == 2 for v in by_id.values())
    later = {runs_id: read_back(max(v, key=lambda p: p.stat().st_mtime_ns))["summary"] for runs_id, v in by_id.items()}
    assert "accuracy" not in later[s["id"]]  # the gate's own write: the verdict only
    assert later[s["id"]]["verdict"] == "INCONCLUSIVE" == later[s["id"]]["gate_status"]
    assert later[s["id"]]["gate_reasons"] == summary["gate_reasons"]
    assert later[runs["baseline"]["id"]]["gate_status"] is None  # the baseline is not judged: every reason
    assert later[runs["baseline"]["id"]]["gate_reasons"] == verdict["reasons"]


def test_declared_bytes_are_named_declared():
    """An engine that cannot measure its cache (backend=openai) declares its bytes: the ratio says so by its name."""
    from evalkit.report.wandb_log import variant_summary

    recs = needle_rows()
    for r in recs:
        r["kv_bytes_source"] = "declared: q8_0, 1.0625 bytes per value (evalkit.plan)"
    own = as_rows([r for r in recs if r["variant"] == "snapkv@0.5"])
    fields = variant_summary(summarize(as_rows(recs))["snapkv@0.5"], own)
    assert fields["kv_bytes_are"] == "declared" and fields["kv_ratio_declared"] == pytest.approx(0.5)
    assert "kv_ratio_measured" not in fields


def test_a_variant_is_found_under_the_label_a_merge_gave_it():
    labels = ["baseline", "smollm2/h2o@0.5", "gemma/h2o@0.5", "needle/snapkv@0.25 [job1]", "snapkv@0.25 [job2]"]
    assert label_of("baseline", labels) == "baseline"
    assert label_of("h2o@0.5", labels) is None  # two models ran it: the run's own label cannot be told from here
    assert label_of("h2o@0.5", ["baseline", "smollm2/h2o@0.5"]) == "smollm2/h2o@0.5"
    assert label_of("snapkv@0.25", ["needle/snapkv@0.25 [job1]"]) == "needle/snapkv@0.25 [job1]"
    assert label_of("h2o@0.25", labels) is None


def test_a_sweep_logs_each_jobs_variants_and_its_merged_verdict_to_the_same_runs(tmp_path, offline):
    """Two jobs with logger=wandb: each logs its baseline and its policy; the sweep's one gate adds the merged verdict
    to those four W&B runs, found again by the ids each job recorded in its wandb.json."""
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", "policy=h2o,streaming_llm",
        "policy.budget=0.25", "gate=default", "gate.min_baseline_accuracy=null", "logger=wandb", "logger.mode=offline",
        f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    verdict = json.loads((sweep / "verdict.json").read_text())
    assert result.returncode == {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 2}[verdict["verdict"]], result.stderr
    jobs = [p.parent for p in sorted(sweep.rglob("wandb.json"))]
    assert len(jobs) == 2
    for job in jobs:
        recorded = json.loads((job / "wandb.json").read_text())
        assert recorded["group"] == "needle" and recorded["mode"] == "offline"
        policy = next(v for v in recorded["runs"] if v != "baseline")
        written = defaultdict(list)
        for local in (job / "wandb").glob("offline-run-*"):
            written[run_id(local)].append(local)
        assert set(written) == set(recorded["runs"].values())  # the job's two runs, and no other
        newest = {i: read_back(max(v, key=lambda p: p.stat().st_mtime_ns)) for i, v in written.items()}
        gated = newest[recorded["runs"][policy]]["summary"]
        assert gated["verdict"] == verdict["verdict"]
        assert gated["gate_status"] == verdict["variants"][policy]["gate"]["status"]
        assert newest[recorded["runs"]["baseline"]]["summary"]["verdict"] == verdict["verdict"]


def test_gate_wandb_without_the_package_is_one_line_and_exit_2_before_judging(tmp_path, monkeypatch, capsys):
    run_dir = write_run(tmp_path / "run", needle_rows(), run_info("r1"))
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where the package is not installed
    assert gate_main([str(run_dir), "--wandb"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install wandb" in err and "Traceback" not in err
    assert not (run_dir / "verdict.json").exists()  # stopped before judging


def test_a_verdict_older_than_the_last_row_is_not_logged(tmp_path, offline):
    """A resumed run has rows the old verdict.json never judged: neither its status nor the file goes to W&B."""
    from evalkit.report.wandb_log import log_run

    run_dir = write_run(tmp_path / "run", [r for r in needle_rows() if r["variant"] != "snapkv@0.5"], run_info("r2"))
    (run_dir / "verdict.json").write_text(json.dumps({"verdict": "PASS", "reasons": [], "variants": {}}))
    then = (run_dir / "samples.jsonl").stat().st_mtime - 60
    os.utime(run_dir / "verdict.json", (then, then))
    for r in map(read_back, log_run(run_dir, "evalkit", mode="offline")):
        assert "verdict" not in r["summary"] and r["summary"]["n"] == 12
        assert r["artifacts"]["evalkit-r2"] == {"samples.jsonl", "report.html"}
