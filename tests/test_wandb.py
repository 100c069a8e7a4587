"""W&B as its users compare experiments, read back from the offline run files W&B wrote (no mock of wandb): a run per
(evalkit run, variant) with its config and summary fields, its per-sample table, the report page and the run's files
as an artifact; `python -m evalkit.gate --wandb` adds the verdict to the very same runs."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from evalkit.cli.gate import main as gate_main
from evalkit.records.summary import summarize
from evalkit.records.verdict import label_of
from evalkit.tracking import offline_runs
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


def newest(folder: Path) -> dict[str, dict]:
    """Each W&B run under the folder's wandb/, read back, by id; fails where an id holds more than one offline run
    (W&B would replace the first by the second on `wandb sync`: one id, one run)."""
    runs = offline_runs(folder)
    assert all(len(v) == 1 for v in runs.values()), {k: [p.name for p in v] for k, v in runs.items()}
    return {i: read_back(v[0]) for i, v in runs.items()}


def table_of(local: Path, name: str) -> list[dict]:
    (path,) = (local / "files" / "media" / "table").glob(f"{name}_*.table.json")
    doc = json.loads(path.read_text())
    return [dict(zip(doc["columns"], row, strict=True)) for row in doc["data"]]


def test_one_whole_run_per_variant_logged_after_the_gate_then_updated_in_place(tmp_path, offline):
    from evalkit.report.wandb_log import log_run

    recs = needle_rows()  # baseline 12/12; streaming_llm@0.25 loses 4 of 12 at a quarter of the bytes; snapkv@0.5 none
    run_dir = write_run(tmp_path / "run", recs, run_info("r1"))
    assert gate_main([str(run_dir)]) == 2  # 12 samples: INCONCLUSIVE; verdict.json is written before W&B logs
    verdict = json.loads((run_dir / "verdict.json").read_text())
    logged = [read_back(p) for p in log_run(run_dir, "evalkit", entity=None, mode="offline", thresholds=DEFAULT)]

    runs = {r["config"]["variant"]: r for r in logged}
    assert sorted(runs) == ["baseline", "snapkv@0.5", "streaming_llm@0.25"]  # a W&B run each, the baseline included
    assert set(newest(run_dir)) == {r["id"] for r in logged}  # three ids, one offline run each
    (group,) = {r["group"] for r in logged}  # the experiment: task, model, the dataset's digest
    assert group.startswith("needle · m · data ") and len(group.split("data ")[1]) == 12
    s = runs["streaming_llm@0.25"]
    assert s["name"] == "streaming_llm@0.25 · needle · m" and runs["baseline"]["name"] == "baseline · needle · m"
    assert {k: s["config"][k] for k in ("task", "model", "backend", "policy", "budget", "quantization", "prefill")} == {
        "task": "needle",
        "model": "m",
        "backend": "hf",
        "policy": "streaming_llm",
        "budget": 0.25,
        "quantization": "none",
        "prefill": "oneshot",
    }
    assert (s["config"]["seed"], s["config"]["protocol"], s["config"]["dataset_path"]) == (
        0,
        "query_agnostic",
        "generated by task=needle",
    )
    assert s["config"]["dataset_digest"] == group.split("data ")[1]
    assert s["config"]["gate"] == DEFAULT and runs["baseline"]["config"]["policy"] == "baseline"
    assert runs["baseline"]["config"]["budget"] == 1.0  # the whole cache: a point on an accuracy-vs-budget plot
    summary = s["summary"]
    assert summary["accuracy"] == pytest.approx(8 / 12) and summary["baseline_accuracy"] == 1.0
    assert summary["drop"] == pytest.approx(4 / 12) and (summary["lost"], summary["gained"]) == (4, 0)
    assert summary["flip_causes"] == {"evicted": 4}  # the needle's tokens held in 5% of the layers' worth
    assert summary["drop_lower"] < 4 / 12 < summary["drop_upper"] <= 1
    assert summary["kv_ratio_measured"] == pytest.approx(25 / 100) and summary["kv_bytes_are"] == "measured"
    assert runs["snapkv@0.5"]["summary"]["kv_ratio_measured"] == pytest.approx(50 / 100)
    # per cell: the 4 lost needles are the 4 samples at depth 0.5 (i % 3 == 1), 2 per context length
    cells = {k: v for k, v in summary.items() if k.startswith("cells/")}
    assert len(cells) == 6 and all(v["n"] == 2 for v in cells.values())
    assert {k: v["accuracy"] for k, v in cells.items() if "depth=0.5" in k} == {
        "cells/context_length=1024 depth=0.5": 0.0,
        "cells/context_length=2048 depth=0.5": 0.0,
    }
    # the gate judged before W&B logged: its verdict, this variant's status and only this variant's reasons
    assert summary["verdict"] == "INCONCLUSIVE" == summary["gate_status"]
    assert summary["gate_reasons"] and all(r.startswith("streaming_llm@0.25: ") for r in summary["gate_reasons"])
    assert len(summary["gate_reasons"]) == sum(r.startswith("streaming_llm@0.25: ") for r in verdict["reasons"])
    for variant, r in runs.items():
        table = table_of(r["folder"], "samples")
        assert len(table) == sum(x["variant"] == variant for x in recs) == 12  # this variant's rows only
        assert {"question", "answers", "prediction", "context_length", "depth"} <= set(table[0])
        assert "cell" not in table[0] and all(isinstance(t["depth"], float) for t in table)  # a column per cell key
        assert all(isinstance(t["answers"], list) for t in table)
        per_cell = table_of(r["folder"], "cells")
        assert len(per_cell) == 6 and {c["depth"] for c in per_cell} == {0.0, 0.5, 1.0}
        (plot,) = (r["folder"] / "files" / "media" / "plotly").glob("tradeoff_*.plotly.json")
        assert plot.stat().st_size < 100_000  # a light panel: the 5 MB page is in the artifact only
        assert not list((r["folder"] / "files" / "media").glob("html/*"))
        assert r["artifacts"]["evalkit-r1"] == {"samples.jsonl", "verdict.json", "report.html"}
    lost = [t for t in table_of(s["folder"], "samples") if t["flip"] == "lost"]
    assert len(lost) == 4 and {t["depth"] for t in lost} == {0.5} and {t["flip_cause"] for t in lost} == {"evicted"}

    # a later gate with --wandb: the same three runs, logged whole again (accuracy and verdict), one offline run each
    assert gate_main([str(run_dir), "--wandb", "--gate", "default"]) == 2
    later = newest(run_dir)
    assert set(later) == {r["id"] for r in logged}
    again = later[s["id"]]["summary"]
    assert again["accuracy"] == pytest.approx(8 / 12) and again["n"] == 12  # the figures stay beside the verdict
    assert again["verdict"] == "INCONCLUSIVE" == again["gate_status"]
    assert again["gate_reasons"] == summary["gate_reasons"]
    assert later[s["id"]]["config"]["budget"] == 0.25 and later[s["id"]]["group"] == group
    assert later[runs["baseline"]["id"]]["summary"]["gate_status"] is None  # the baseline is not judged: every reason
    assert later[runs["baseline"]["id"]]["summary"]["gate_reasons"] == verdict["reasons"]


def test_offline_runs_are_counted_per_id(tmp_path):
    """W&B names an offline run offline-run-TIME-ID, with -N where two runs of one id start in the same second."""
    for name in ("offline-run-20261207_175339-aaaa", "offline-run-20261207_175339-aaaa-1", "offline-run-2026-bbbb"):
        (tmp_path / "wandb" / name).mkdir(parents=True)
    (tmp_path / "wandb" / "debug.log").write_text("")
    runs = offline_runs(tmp_path)
    assert {k: len(v) for k, v in runs.items()} == {"aaaa": 2, "bbbb": 1}
    assert offline_runs(tmp_path / "none") == {}


def test_a_gated_run_logs_three_runs_once_and_keeps_them_through_gate_and_extension(tmp_path, offline):
    """The command line, as a user runs it: three variants (the baseline and two), gated, logger=wandb offline; then
    `python -m evalkit.gate RUN --wandb`; then the run extended (resume=true, more samples). Three W&B runs each time,
    the same ids, one offline run per id, each holding the metrics, the verdict and the artifact with verdict.json."""
    run_dir = tmp_path / "run"
    args = [
        "model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", "task.max_new_tokens=4",
        "variants=[streaming_llm@0.25,h2o@0.5]", "gate=default", "gate.min_baseline_accuracy=null", "logger=wandb",
        "logger.mode=offline",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    first = run_cli(*args)
    assert first.returncode == 2, first.stderr[-2000:]  # one sample: INCONCLUSIVE
    assert first.stdout.index("INCONCLUSIVE") < first.stdout.index("W&B runs written")  # gated first, then logged
    runs = newest(run_dir)
    assert len(runs) == 3
    ids = set(runs)
    by_variant = {r["config"]["variant"]: r for r in runs.values()}
    assert sorted(by_variant) == ["baseline", "h2o@0.5", "streaming_llm@0.25"]
    assert by_variant["h2o@0.5"]["name"] == "h2o@0.5 · needle · tiny-random"
    for r in runs.values():
        assert r["summary"]["n"] == 1 and r["summary"]["verdict"] == "INCONCLUSIVE"
        assert r["artifacts"][f"evalkit-{r['config']['evalkit_run_id']}"] == {
            "samples.jsonl",
            "verdict.json",
            "report.html",
        }
        assert r["config"]["context_lengths"] == [128] and r["config"]["samples_per_cell"] == 1
    (question,) = {t["question"] for t in table_of(by_variant["h2o@0.5"]["folder"], "samples")}
    assert "magic number" in question

    assert gate_main([str(run_dir), "--wandb", "--gate", "default"]) == 2  # the baseline scores 0: CANNOT JUDGE
    runs = newest(run_dir)
    assert set(runs) == ids and all(r["summary"]["verdict"] == "CANNOT JUDGE" for r in runs.values())
    assert all(r["summary"]["n"] == 1 and "accuracy" in r["summary"] for r in runs.values())

    extended = run_cli(*args, "task.samples_per_cell=2", "resume=true")
    assert extended.returncode == 2, extended.stderr[-2000:]
    runs = newest(run_dir)
    assert set(runs) == ids  # the same three runs, updated
    assert all(r["summary"]["n"] == 2 and r["summary"]["verdict"] == "INCONCLUSIVE" for r in runs.values())
    assert all(r["config"]["samples_per_cell"] == 2 for r in runs.values())
    assert len({r["group"] for r in runs.values()} | {by_variant["baseline"]["group"]}) == 1  # the same experiment


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


def test_a_sweep_logs_each_jobs_variants_once_with_its_merged_verdict(tmp_path, offline):
    """Two jobs with logger=wandb: the sweep's one gate judges them, then each job's baseline and policy are logged
    once (four W&B runs, one offline run each, found by the ids each job recorded in its wandb.json), whole: the
    job's accuracy beside the merged verdict."""
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
    groups = set()
    for job in jobs:
        recorded = json.loads((job / "wandb.json").read_text())
        assert recorded["mode"] == "offline"
        groups.add(recorded["group"])
        policy = next(v for v in recorded["runs"] if v != "baseline")
        written = newest(job)  # one offline run per id
        assert set(written) == set(recorded["runs"].values())  # the job's two runs, and no other
        gated = written[recorded["runs"][policy]]
        assert gated["group"] == recorded["group"] and gated["summary"]["n"] == 1 and "accuracy" in gated["summary"]
        assert gated["summary"]["verdict"] == verdict["verdict"]
        assert gated["summary"]["gate_status"] == verdict["variants"][policy]["gate"]["status"]
        assert written[recorded["runs"]["baseline"]]["summary"]["verdict"] == verdict["verdict"]
    assert len(groups) == 1 and next(iter(groups)).startswith("needle · tiny-random · data ")  # one experiment


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


def test_a_table_column_of_mixed_kinds_is_written_as_text():
    """W&B refuses a table whose column mixes numbers and text (a JSONL's `depth: "deep"` beside `depth: 0.5`)."""
    from evalkit.report.wandb_fields import uniform

    rows = [["a", 0.5, 1, True, None], ["b", "deep", 2.0, False, None], ["c", None, 3, True, "x"]]
    assert uniform(rows) == [["a", "0.5", 1, True, None], ["b", "deep", 2.0, False, None], ["c", None, 3, True, "x"]]
    assert uniform([]) == []
