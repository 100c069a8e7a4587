"""Weights & Biases: one W&B run per (evalkit run, variant), the baseline included, in a group per experiment, logged
once the run is judged, whole in one write.

Each run's config says what was compared (task, model, backend, policy, budget, quantization, prefill, protocol, the
dataset's path and digest, seed, context lengths, samples per cell, the gate's thresholds) and its summary what came
out (accuracy beside the baseline's, the paired drop with the gate's bounds where it judged it and a fixed-n interval
named descriptive, lost / gained and their causes, per-cell metrics, the KV ratio and whether its bytes were measured
or declared, the gate's verdict and reasons where it judged) (evalkit.report.wandb_fields). Each run also holds its
per-sample table, its per-cell table, the trade-off plot as a light Plotly panel and, as a versioned artifact of the
evalkit run (the same files: one version, whichever variant logs it), samples.jsonl, verdict.json and the report page.

Run ids are derived (evalkit.tracking.run_id), and every write is the whole run: after `python -m evalkit.gate
--wandb`, or an extended run (resume=true), the run is logged again, whole, to the same ids (W&B's resume online; the
offline folder of the id replaced, evalkit.tracking.log_to_run). The verdict is read from verdict.json where the gate
wrote it for these rows (evalkit.records.shown): this layer never judges.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalkit.records import SAMPLES, Row, read_rows
from evalkit.records.merged import label_order
from evalkit.records.reading import read_runs, run_folders
from evalkit.records.shown import shown_verdict
from evalkit.records.summary import summarize
from evalkit.records.verdict import VERDICT, label_of, verdict_fields
from evalkit.report.build import report
from evalkit.report.data import verdict_view
from evalkit.report.page import tradeoff_figure
from evalkit.report.wandb_fields import (
    cell_summary,
    cell_table,
    experiment_group,
    run_name,
    sample_table,
    variant_config,
    variant_summary,
)
from evalkit.tracking import Target, load_target, log_to_run, run_id, save_target, wandb_package

PROJECT = "evalkit"  # conf/logger/wandb.yaml's project: where `gate --wandb` logs a run that recorded no wandb.json


@dataclass(frozen=True)
class Judged:
    """What the judged folder (a run, a sweep, the gate's --out) says of its rows: the gate's verdict.json where it
    judged exactly them (None otherwise), the report page and the trade-off figure of all its variants."""

    folder: Path
    verdict: dict[str, Any] | None
    page: Path
    tradeoff: Any


def judged_view(folder: Path, runs: list[Path] | None = None) -> Judged:
    """The report of `runs` (default: the folder) written into the folder's report/, with the verdict.json the gate
    wrote into the folder for exactly these rows."""
    runs = runs or [folder]
    records = read_runs(runs)
    page = report(runs, folder / "report")[0]
    figure = tradeoff_figure(summarize(records.rows, label_order), verdict_view(runs, records))
    verdict = shown_verdict(runs, records, folder / VERDICT)[0]
    return Judged(folder, verdict, page, figure)


def log_run(
    out_dir: Path,
    project: str,
    group: str | None = None,
    entity: str | None = None,
    mode: str = "auto",
    thresholds: dict | None = None,
    judged: Judged | None = None,
) -> list[Path]:
    """Log an evalkit run folder to W&B, a run per variant, each whole; returns their local W&B folders. `judged`:
    the verdict and page that go with the rows (a sweep's, the gate's --out); default: the folder's own. `group`:
    default the experiment (task, model, dataset digest)."""
    wandb = wandb_package()
    rows, info = read_rows(out_dir / SAMPLES), json.loads((out_dir / "run.json").read_text())
    judged = judged or judged_view(out_dir)
    target = Target(project, group or experiment_group(info, rows), str(out_dir), entity, mode)
    summary = summarize(rows, label_order)
    ids = {v: run_id(info["run_id"], v) for v in summary}
    save_target(out_dir, target, ids)
    verdict = judged.verdict
    labels = list((verdict or {}).get("variants") or summary)
    thresholds = thresholds or (verdict or {}).get("thresholds")
    files = [out_dir / SAMPLES, judged.page, *([judged.folder / VERDICT] if verdict else [])]  # never a stale one
    local = []
    for variant, s in summary.items():
        own = [r for r in rows if r.variant == variant]
        fields = variant_summary(s, own) | cell_summary(s)
        fields |= verdict_fields(verdict, label_of(variant, labels)) if verdict else {}
        media = _media(wandb, s, own, judged)
        artifact = files_artifact(wandb, info["run_id"], files)
        name = run_name(variant, info, own)
        local.append(
            log_to_run(target, ids[variant], name, variant_config(own, info, thresholds), fields, media, artifact)
        )
    return local


def log_folders(run_dirs: list[Path], judged: Path, thresholds: dict | None = None) -> list[Path]:
    """Log every run folder under `run_dirs` once `judged` (where the gate wrote verdict.json for them) holds the
    verdict: each to the project and group its wandb.json recorded (project `evalkit` and the experiment's group where
    none), whole; returns the local W&B folders written."""
    view = judged_view(judged, run_dirs)
    local = []
    for folder in run_folders(run_dirs):
        if not (folder / "run.json").exists():
            continue  # no run.json: no W&B run can be named from it (the verdict says why)
        t = load_target(folder) or Target(PROJECT, "", str(folder))
        local += log_run(folder, t.project, t.group or None, t.entity, t.mode, thresholds, view)
    return local


def record_target(out_dir: Path, project: str, group: str | None, entity: str | None, mode: str) -> None:
    """Record where the folder's W&B runs will go (wandb.json) without logging them: a sweep's job, logged by the
    sweep once its one gate has judged every job (log_folders)."""
    rows, info = read_rows(out_dir / SAMPLES), json.loads((out_dir / "run.json").read_text())
    target = Target(project, group or experiment_group(info, rows), str(out_dir), entity, mode)
    save_target(out_dir, target, {v: run_id(info["run_id"], v) for v in sorted({r.variant for r in rows})})


def _media(wandb, s: dict[str, Any], own: list[Row], judged: Judged) -> dict[str, Any]:
    """The variant's tables (per sample, per cell) and the experiment's trade-off as a Plotly panel (a few kB: the
    report page itself is in the artifact, once)."""
    columns, data = sample_table(own)
    cell_columns, cells = cell_table(s, own)
    return {
        "samples": wandb.Table(columns=columns, data=data),
        "cells": wandb.Table(columns=cell_columns, data=cells),
        "tradeoff": wandb.Plotly(judged.tradeoff),
    }


def files_artifact(wandb, identity: str, paths: list[Path]):
    """The run's records, verdict and report as one versioned W&B artifact (the same files: the same version)."""
    artifact = wandb.Artifact(f"evalkit-{identity}", type="evalkit-run")
    for path in paths:
        artifact.add_file(str(path), name=path.name)
    return artifact
