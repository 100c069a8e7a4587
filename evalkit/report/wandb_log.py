"""Weights & Biases: one W&B run per (evalkit run, variant), the baseline included, in a group per experiment.

Each run's config says what was compared (task, model, backend, policy, budget, quantization, prefill, protocol, the
gate's thresholds) and its summary what came out (accuracy, the paired drop with the gate's bounds where it judged
it and a fixed-n interval named descriptive, lost / gained, the KV
ratio and whether its bytes were measured or declared, and the gate's verdict where it judged), so the W&B UI groups
by policy, plots accuracy against budget and filters by verdict. Each run also holds its per-sample table, the report
page as an HTML panel and, as a versioned artifact, samples.jsonl, verdict.json and the page. Run ids are derived
(evalkit.tracking.run_id), so `python -m evalkit.gate --wandb` adds its verdict to the same runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evalkit.records import SAMPLES, Row, read_rows
from evalkit.records.merged import label_order
from evalkit.records.reading import read_runs
from evalkit.records.shown import shown_verdict
from evalkit.records.summary import summarize
from evalkit.records.verdict import VERDICT, verdict_fields
from evalkit.report.build import report
from evalkit.tracking import Target, log_to_run, run_id, save_target, wandb_package

DECLARED = "declared"  # evalkit.backends.kvbytes.DECLARED: how a row's kv_bytes_source names declared bytes

COLUMNS = [
    "sample_id",
    "cell",
    "score",
    "baseline_score",
    "flip",
    "prediction",
    "kv_bytes",
    "kv_bytes_baseline",
    "context_tokens",
]


def variant_config(rows: list[dict], info: dict, thresholds: dict | None) -> dict[str, Any]:
    """What one variant's rows were measured with, as flat fields the W&B UI groups and plots by."""
    first = rows[0]
    policy, quant = first.get("policy") or {}, first.get("quant") or {}
    config = info.get("config") or {}
    return {
        "variant": first.variant,
        "task": first.task or (config.get("task") or {}).get("name"),
        "model": (info.get("model") or {}).get("name") or (config.get("model") or {}).get("name"),
        "backend": first.get("backend") or "hf",
        "policy": policy.get("name"),
        "budget": policy.get("budget"),
        "quantization": quant.get("name") or "none",
        "prefill": (first.get("prefill") or {}).get("mode", "oneshot"),
        "protocol": first.protocol or info.get("protocol"),
        "policy_settings": policy,
        "evalkit_run_id": info.get("run_id"),
        "gate": thresholds,
    }


def variant_summary(s: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    """The variant's results: accuracy beside the baseline's, the paired drop and its bounds, flips and KV ratio."""
    p = s["paired"]
    declared = any(str(r.get("kv_bytes_source", "")).startswith(DECLARED) for r in rows)
    return {
        "n": s["n"],
        "accuracy": s["accuracy"],
        "baseline_accuracy": s["baseline_accuracy"],
        "drop": p["drop"],
        # a fixed-n interval, descriptive: the drop bound the gate decided on is drop_lower / drop_upper, with the
        # gate's verdict (evalkit.records.verdict.verdict_fields)
        "drop_lower_descriptive": p["drop_bounds"][0],
        "drop_upper_descriptive": p["drop_bounds"][1],
        "drop_method_descriptive": p["method"],
        "mcnemar_p": p["mcnemar_p"],
        "lost": s["lost"],
        "gained": s["gained"],
        "kv_ratio": s["kv_ratio"],
        "kv_ratio_basis": s["kv_ratio_basis"],
        "kv_ratio_context": s["kv_ratio_context"],  # the compressed context alone: not what the gate judged
        f"kv_ratio_{DECLARED if declared else 'measured'}": s["kv_ratio_measured"],
        "kv_bytes_are": DECLARED if declared else "measured",
        "kv_bytes": s["kv_bytes"],
    }


def current_verdict(out_dir: Path) -> dict[str, Any] | None:
    """verdict.json where the gate wrote it for the rows the folder holds now, as its last look records it (the
    report's and the planner's check, evalkit.records.shown: an older one judged fewer samples, an edited one is not
    the gate's)."""
    return shown_verdict([out_dir], read_runs([out_dir]))[0]


def log_run(
    out_dir: Path,
    project: str,
    group: str | None = None,
    entity: str | None = None,
    mode: str = "auto",
    thresholds: dict | None = None,
) -> list[Path]:
    """Log an evalkit run folder to W&B, a run per variant; returns their local W&B folders."""
    wandb = wandb_package()
    rows, info = read_rows(out_dir / SAMPLES), json.loads((out_dir / "run.json").read_text())
    summary = summarize(rows, label_order)
    page = report([out_dir], out_dir / "report")[0]
    verdict = current_verdict(out_dir)
    target = Target(
        project=project,
        group=group or str((info.get("config") or {}).get("task", {}).get("name")),
        dir=str(out_dir),
        entity=entity,
        mode=mode,
    )
    ids = {v: run_id(info["run_id"], v) for v in summary}
    save_target(out_dir, target, ids)
    local = []
    for variant, s in summary.items():
        own = [r for r in rows if r.variant == variant]
        fields = variant_summary(s, own) | (verdict_fields(verdict, variant) if verdict else {})
        table = wandb.Table(columns=COLUMNS, data=[[_cell(r.get(c)) for c in COLUMNS] for r in own])
        media = {"samples": table, "report": wandb.Html(page.read_text(), inject=False)}
        config = variant_config(own, info, thresholds)
        files = [out_dir / SAMPLES, page, *([out_dir / VERDICT] if verdict else [])]  # never a stale verdict
        artifact = files_artifact(wandb, info["run_id"], files)
        local.append(log_to_run(target, ids[variant], f"{out_dir.name}/{variant}", config, fields, media, artifact))
    return local


def files_artifact(wandb, identity: str, paths: list[Path]):
    """The run's records and report as one versioned W&B artifact (the same files: the same version)."""
    artifact = wandb.Artifact(f"evalkit-{identity}", type="evalkit-run")
    for path in paths:
        artifact.add_file(str(path), name=path.name)
    return artifact


def _cell(value: Any) -> Any:
    return str(value) if isinstance(value, dict) else value
