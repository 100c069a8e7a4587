"""The gate's verdict on the W&B runs of the runs it judged (evalkit.tracking): status, reasons, each variant's status.

The runs are found again by their derived ids, from each folder's run.json and its variants' names, in the project
and group `logger=wandb` recorded in the folder's wandb.json (project `evalkit`, group the task, when it holds none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.records import SAMPLES, read_rows
from evalkit.records.verdict import label_of, verdict_fields
from evalkit.tracking import Target, load_target, log_to_run, run_id

PROJECT = "evalkit"  # conf/logger/wandb.yaml's project


def log_verdict(infos: list[dict[str, Any]], doc: dict[str, Any]) -> list[Path]:
    """Add the verdict `doc` to the W&B run of every variant of every judged run (`infos`: their run.json, with
    `_folder`); returns the local W&B folders written."""
    labels = list(doc.get("variants") or {})
    local = []
    for info in infos:
        if "run_id" not in info:
            continue  # not an evalkit run.json: the verdict says so, and no W&B run can be named from it
        folder = Path(info["_folder"])
        target = load_target(folder) or Target(
            project=PROJECT, group=str((info.get("config") or {}).get("task", {}).get("name")), dir=str(folder)
        )
        try:
            variants = sorted({r.variant for r in read_rows(folder / SAMPLES)})
        except ConfigError:
            continue  # rows that cannot be read: the verdict says so, and there is no variant to log it to
        for variant in variants:
            fields = verdict_fields(doc, label_of(variant, labels))
            wandb_id = run_id(info["run_id"], variant)
            local.append(log_to_run(target, wandb_id, f"{folder.name}/{variant}", summary=fields))
    return local
