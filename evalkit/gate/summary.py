"""Variant labels across runs: runs merged into one table, and chunked variants beside their one-shot twins (a
run's own summary is evalkit.records.summary)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from evalkit.records import BASELINE, sample_identity, sample_key
from evalkit.records.summary import mean, paired, peak_prefill


def is_baseline(label: str) -> bool:
    """True for `baseline`, and for the baseline of a merged run (`smollm2-135m/baseline`, `baseline [job]`)."""
    return label.split(" [")[0].rsplit("/", 1)[-1] == BASELINE


def label_order(label: str) -> tuple:
    """Sort key: per model/task prefix, the baseline first, then the variants by name."""
    prefix, _, name = label.split(" [")[0].rpartition("/")
    return prefix, not is_baseline(label), name, label


def merge(runs: list[tuple[Path, dict, list[dict]]]) -> list[dict]:
    """One table from the rows of several runs (folder, run.json, rows), e.g. the jobs of a Hydra multirun.

    Samples are identified across runs by their sample key (evalkit.records.sample_key: the run's task config less
    its sample count, seed and input files, and the sample id), never by the id alone: two runs whose ids collide
    (needle at two seeds, two datasets numbered from 0) give two samples each, and a merged id that would collide
    gets the key's digest, `L256-d0.25-0#3f2a9c01`. Variants are labelled so that rows that are not the same
    measurement never mix: when the runs differ in model or task, labels get a `model/` or `task/` prefix; a label
    measured with different settings (policy options, storage, prefill, protocol) in different runs, or whose runs
    disagree on the same sample, gets its run folder appended, `h2o@0.5 [policy.recent=0.2]`. The same measurement
    in several runs (the baseline that every job of a sweep repeats) is kept once per sample. Nothing depends on the
    order of the runs.
    """
    if len(runs) == 1:
        return runs[0][2]

    def model(info: dict) -> str:
        return (info.get("model") or {}).get("name") or str((info.get("config") or {}).get("model", {}).get("name"))

    models = {model(info) for _, info, _ in runs}
    tasks = {r.get("task") for _, _, rows in runs for r in rows}
    common = Path(os.path.commonpath([folder for folder, _, _ in runs]))
    labelled = []  # (label, settings, sample key, row, folder)
    for folder, info, rows in sorted(runs, key=lambda run: str(run[0])):
        prefix = "/".join(
            [
                *([str(rows[0].get("task"))] if len(tasks) > 1 and rows else []),
                *([model(info)] if len(models) > 1 else []),
            ]
        )
        identity, where = sample_identity(info), str(folder.relative_to(common)) if folder != common else folder.name
        for r in rows:
            settings = json.dumps([r.get(k) for k in ("policy", "quant", "prefill", "protocol")], sort_keys=True)
            label = f"{prefix}/{r['variant']}" if prefix else r["variant"]
            labelled.append((label, settings, sample_key(identity, info, r["sample_id"]), r, where))
    split = _split_labels(labelled)
    keys_of_id: dict[str, set[str]] = defaultdict(set)
    for _, _, key, r, _ in labelled:
        keys_of_id[str(r["sample_id"])].add(key)
    out, seen = [], set()
    for label, _, key, r, folder in labelled:
        label = f"{label} [{folder}]" if label in split else label
        if (label, key) in seen:
            continue
        seen.add((label, key))
        sid = r["sample_id"]
        if len(keys_of_id[str(sid)]) > 1:
            sid = f"{sid}#{hashlib.sha256(key.encode()).hexdigest()[:8]}"
        out.append({**r, "variant": label, "sample_id": sid})
    return out


def _split_labels(labelled: list[tuple[str, str, str, dict, str]]) -> set[str]:
    """Labels whose rows are not one measurement: recorded with different settings in different runs, or with
    different answers for the same sample in different runs."""
    settings: dict[str, set[str]] = defaultdict(set)
    answers: dict[tuple[str, str], set[str]] = defaultdict(set)
    for label, setting, key, r, _ in labelled:
        settings[label].add(setting)
        answers[label, key].add(json.dumps([r.get("score"), r.get("prediction")], default=str))
    return {label for label, s in settings.items() if len(s) > 1} | {
        label for (label, _), a in answers.items() if len(a) > 1
    }


def chunked_vs_oneshot(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each chunked variant (`h2o@1024:chunk512`) beside the same policy prefilled in one shot (`h2o@1024`), paired
    on the samples both ran: accuracies, chunked minus one-shot with its 95% CI, and the peak KV bytes of each."""
    by_label: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by_label[r["variant"]][r["sample_id"]] = r
    out = []
    for label in sorted(by_label, key=label_order):
        chunked = by_label[label]
        chunk = (next(iter(chunked.values())).get("prefill") or {}).get("chunk")
        if not chunk:
            continue
        twin = label.replace(f":chunk{chunk}", "", 1)  # the same label, `[folder]` included, without the chunk
        name = twin.split(" [")[0]
        base = by_label.get(twin) or by_label.get(name) or {}
        ids = [i for i in chunked if i in base]
        if not ids:
            continue
        stats = paired([base[i]["score"] for i in ids], [chunked[i]["score"] for i in ids])
        out.append(
            {
                "variant": name,
                "chunk": chunk,
                "n": len(ids),
                "baseline": mean([base[i]["baseline_score"] for i in ids]),
                "oneshot": stats["baseline"],
                "chunked": stats["policy"],
                "difference": 0.0 - stats["drop"],  # 0.0 - x: never a negative zero
                "difference_bounds": [0.0 - stats["drop_bounds"][1], 0.0 - stats["drop_bounds"][0]],
                "chunked_lost": stats["lost"],
                "chunked_gained": stats["gained"],
                "oneshot_peak_kv_bytes": max(peak_prefill(base[i]) for i in ids),
                "chunked_peak_kv_bytes": max(chunked[i]["peak_kv_bytes"] for i in ids),
                "chunked_peak_tokens": max(chunked[i].get("prefill_peak_tokens") or 0 for i in ids),
            }
        )
    return out
