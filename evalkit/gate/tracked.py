"""The gate's verdict on the W&B runs of the runs it judged (evalkit.tracking): status, reasons, each variant's status.

The runs are found again by their derived ids, from each folder's run.json and its variants' names, in the project
and group `logger=wandb` recorded in the folder's wandb.json (project `evalkit`, group the task, when it holds none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.gate.outputs import drop_bound
from evalkit.records import SAMPLES, read_rows
from evalkit.tracking import Target, load_target, log_to_run, run_id

PROJECT = "evalkit"  # conf/logger/wandb.yaml's project


def verdict_fields(doc: dict[str, Any], label: str | None) -> dict[str, Any]:
    """A verdict as one W&B run's summary fields: the overall status, the variant's own status and reasons (every
    reason, for the baseline and for a variant the verdict does not name), and the drop bound the gate decided on
    with its method (the one drop bound: the run's own summary names its fixed-n interval descriptive)."""
    entry = (doc.get("variants") or {}).get(label) or {} if label else {}
    status = entry.get("gate") or {}
    reasons = doc.get("reasons") or []
    own = [r for r in reasons if label and r.startswith(f"{label}: ")]
    bound = drop_bound(entry)
    drop = {} if bound is None else dict(zip(("drop_lower", "drop_upper"), bound["bounds"], strict=True))
    if bound is not None:
        drop["drop_bound_method"] = bound["method"]
    fields = {"verdict": doc.get("verdict"), "gate_status": status.get("status"), "gate_reasons": own or reasons}
    return fields | drop | (search_fields(doc, label) if label else {})


def search_fields(doc: dict[str, Any], label: str) -> dict[str, Any]:
    """In a budget search, the answer for the variant's policy under `search/`: its status and statement, the safe
    budget, the KV ratio of the cache decoded from at it, the sequences it buys beside the full cache's, and this
    budget's status in the search (every variant of a policy carries its policy's answer, so a W&B panel grouped by
    policy reads it from any of them)."""
    search = doc.get("search") if isinstance(doc.get("search"), dict) else {}
    policies = search.get("policies") if isinstance(search.get("policies"), dict) else {}
    for chain, entry in policies.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("steps"), list):
            continue
        steps = {st.get("variant"): st for st in entry["steps"] if isinstance(st, dict)}
        if label not in steps:
            continue
        safe = steps.get(entry.get("safe_variant")) or {}
        capacity = entry.get("capacity") if isinstance(entry.get("capacity"), dict) else {}
        return {
            "search/policy": chain,
            "search/status": entry.get("status"),
            "search/statement": entry.get("statement"),
            "search/safe_budget": entry.get("safe_budget"),
            "search/safe_kv_ratio": safe.get("kv_ratio"),
            "search/sequences": capacity.get("sequences"),
            "search/sequences_full_cache": capacity.get("sequences_full_cache"),
            "search/times_the_sequences": capacity.get("times"),
            "search/step_status": steps[label].get("status"),
            "search/procedure": search.get("procedure"),
        }
    return {}


def label_of(variant: str, labels: list[str]) -> str | None:
    """The verdict's label for a run's own variant name: the name itself, or the one merged label that adds a
    `model/` or `task/` prefix or a ` [folder]` suffix to it (evalkit.gate.summary.merge); None when not one."""
    if variant in labels:
        return variant
    found = [x for x in labels if x.split(" [")[0].endswith(f"/{variant}") or x.split(" [")[0] == variant]
    return found[0] if len(found) == 1 else None


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
