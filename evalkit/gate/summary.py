"""Paired summaries of a run: every variant against the baseline on the same samples."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from evalkit.gate.stats import flip_cause, mcnemar_exact, paired_drop
from evalkit.records import BASELINE, sample_identity, sample_key
from evalkit.units import fmt_bytes

FIDELITY = ("kl_mean", "top1_agreement", "ppl_ratio")


class Group(NamedTuple):
    """What a variant is compared within: the task, the model and the engine of its run. Each has its own baseline:
    variants of different groups never share a Pareto front or an accuracy floor."""

    task: str
    model: str
    backend: str

    def title(self) -> str:
        return f"{self.task} · {self.model} · {self.backend}"


class Label(str):
    """A variant's label in merged rows: the text every table keys on and shows, built from parts that it carries as
    fields, so that nothing parses it again: `name`, the variant as its run recorded it (an opaque string: `/`, `@`,
    `+`, `:`, `=` and spaces are its own); `prefix`, the `task/` or `model/` that tells runs of several tasks or
    models apart ('' when they do not differ); `folder`, the run folder appended to rows that are not one
    measurement (''); `group`, the (task, model, backend) it is compared within."""

    name: str
    prefix: str
    folder: str
    group: Group | None

    def __new__(cls, name: str, prefix: str = "", folder: str = "", group: Group | None = None) -> Label:
        text = f"{prefix}/{name}" if prefix else name
        self = super().__new__(cls, f"{text} [{folder}]" if folder else text)
        self.name, self.prefix, self.folder, self.group = name, prefix, folder, group
        return self

    def __getnewargs__(self) -> tuple:  # pickled and copied with its parts (a sweep's jobs, deepcopy)
        return self.name, self.prefix, self.folder, self.group


def variant_name(label: str) -> str:
    """The variant as its run recorded it: a merged label's `name`, or the label itself (rows of one run)."""
    return label.name if isinstance(label, Label) else label


def group_of(label: str) -> Group | None:
    """The (task, model, backend) a merged label is compared within; None for a label that does not carry one."""
    return label.group if isinstance(label, Label) else None


def is_baseline(label: str) -> bool:
    """True for the full cache's variant: `baseline`, and a merged label whose run recorded it as `baseline`
    (`smollm2-135m/baseline`, `baseline [job]`), never a variant whose own name merely contains it."""
    return variant_name(label) == BASELINE


def label_order(label: str) -> tuple:
    """Sort key: per model/task prefix, the baseline first, then the variants by name."""
    prefix = label.prefix if isinstance(label, Label) else ""
    return prefix, not is_baseline(label), variant_name(label), str(label)


def label_fields(label: str) -> dict[str, Any]:
    """A merged label's parts as the fields of its entry in a machine-readable file (verdict.json): the variant as
    recorded and the run's task, model and backend; none for the label of a single run's rows."""
    if not isinstance(label, Label) or label.group is None:
        return {}
    return {"variant": label.name, "run": label.group._asdict()}


def merge(runs: list[tuple[Path, dict, list[dict]]]) -> list[dict]:
    """One table from the rows of several runs (folder, run.json, rows), e.g. the jobs of a Hydra multirun.

    Samples are identified across runs by their sample key (evalkit.records.sample_key: the run's task config less
    its sample count, seed and input files, and the sample id), never by the id alone: two runs whose ids collide
    (needle at two seeds, two datasets numbered from 0) give two samples each, and a merged id that would collide
    gets the key's digest, `L256-d0.25-0#3f2a9c01`. Each row's variant becomes a Label that carries the variant as
    recorded, and its run's (task, model, backend), as fields. Variants are labelled so that rows that are not the
    same measurement never mix: when the runs differ in model or task, labels get a `model/` or `task/` prefix; a
    label measured with different settings (policy options, storage, prefill, protocol, engine) in different runs,
    or whose runs disagree on the same sample, gets its run folder appended, `h2o@0.5 [policy.recent=0.2]`. The same
    measurement in several runs (the baseline that every job of a sweep repeats) is kept once per sample. Nothing
    depends on the order of the runs.
    """

    def model(info: dict) -> str:
        return (info.get("model") or {}).get("name") or str((info.get("config") or {}).get("model", {}).get("name"))

    def group(info: dict, row: dict) -> Group:
        config = info.get("config") or {}
        task, backend = (v.get("name") if isinstance(v, dict) else v for v in map(config.get, ("task", "backend")))
        # rows name the engine where one other than evalkit's own (hf) ran them
        return Group(str(row.get("task") or task), model(info), str(row.get("backend") or backend or "hf"))

    if len(runs) == 1:
        _, info, rows = runs[0]
        return [{**r, "variant": Label(r["variant"], group=group(info, r))} for r in rows]
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
            g = group(info, r)
            measured = [r.get(k) for k in ("policy", "quant", "prefill", "protocol")] + [g.backend]
            settings = json.dumps(measured, sort_keys=True)
            label = Label(r["variant"], prefix, group=g)
            labelled.append((label, settings, sample_key(identity, info, r["sample_id"]), r, where))
    split = _split_labels(labelled)
    keys_of_id: dict[str, set[str]] = defaultdict(set)
    for _, _, key, r, _ in labelled:
        keys_of_id[str(r["sample_id"])].add(key)
    out, seen = [], set()
    for label, _, key, r, folder in labelled:
        label = Label(label.name, label.prefix, folder, label.group) if label in split else label
        if (label, key) in seen:
            continue
        seen.add((label, key))
        sid = r["sample_id"]
        if len(keys_of_id[str(sid)]) > 1:
            sid = f"{sid}#{hashlib.sha256(key.encode()).hexdigest()[:8]}"
        out.append({**r, "variant": label, "sample_id": sid})
    return out


def _split_labels(labelled: list[tuple[Label, str, str, dict, str]]) -> set[str]:
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
                "baseline": _mean([base[i]["baseline_score"] for i in ids]),
                "oneshot": stats["baseline"],
                "chunked": stats["policy"],
                "difference": 0.0 - stats["drop"],  # 0.0 - x: never a negative zero
                "difference_bounds": [0.0 - stats["drop_bounds"][1], 0.0 - stats["drop_bounds"][0]],
                "chunked_lost": stats["lost"],
                "chunked_gained": stats["gained"],
                "oneshot_peak_kv_bytes": max(_peak_prefill(base[i]) for i in ids),
                "chunked_peak_kv_bytes": max(chunked[i]["peak_kv_bytes"] for i in ids),
                "chunked_peak_tokens": max(chunked[i].get("prefill_peak_tokens") or 0 for i in ids),
            }
        )
    return out


def _peak_prefill(row: dict[str, Any]) -> int:
    """The most KV bytes held while the context was prefilled (rows written before chunked prefill: the baseline's)."""
    return row.get("prefill_peak_kv_bytes") or row["kv_bytes_baseline"]


def cell_key(cell: dict[str, Any]) -> str:
    return " ".join(f"{k}={cell[k]}" for k in sorted(cell))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def paired(baseline: list[float], policy: list[float], level: float = 0.95) -> dict[str, Any]:
    """Accuracies, flips, the accuracy drop with its one-sided bounds at `level` (evalkit.stats: Tango's score
    interval for 0/1 scores, BCa bootstrap for graded ones), and McNemar's exact p-value."""
    p = paired_drop(baseline, policy, level)
    return {
        "n": p.n,
        "baseline": _mean(baseline),
        "policy": _mean(policy),
        "lost": p.lost,
        "gained": p.gained,
        "drop": p.drop,
        "drop_bounds": [p.lower, p.upper],  # one-sided at `level` each
        "level": level,
        "method": p.method,
        "mcnemar_p": mcnemar_exact(p.lost, p.gained),
    }


def _grouped(rows: list[dict[str, Any]], key) -> dict[str, dict[str, Any]]:
    """Paired statistics per group of rows (key(row) -> group name, None to leave a row out)."""
    groups: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in rows:
        k = key(r)
        if k is not None:
            groups[k][0].append(r["baseline_score"])
            groups[k][1].append(r["score"])
    return {k: paired(b, p) for k, (b, p) in sorted(groups.items())}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: accuracy beside the baseline's on the same samples, flips, KV bytes; and per cell."""
    by_variant: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_variant[r["variant"]].append(r)
    out = {}
    for variant, rs in sorted(by_variant.items(), key=lambda kv: label_order(kv[0])):
        overall = paired([r["baseline_score"] for r in rs], [r["score"] for r in rs])
        out[variant] = {
            "n": len(rs),
            "accuracy": overall["policy"],
            "baseline_accuracy": overall["baseline"],
            "lost": overall["lost"],
            "gained": overall["gained"],
            "paired": overall,
            "flip_causes": dict(Counter(c for c in map(flip_cause, rs) if c)),
            # measured: in the dtype the model ran in here (float32 on the CPU)
            "kv_bytes": _mean([r["kv_bytes"] for r in rs]),
            "kv_bytes_baseline": _mean([r["kv_bytes_baseline"] for r in rs]),
            "kv_ratio_measured": _mean([r["kv_bytes"] / r["kv_bytes_baseline"] for r in rs]),
            # judged and planned: against the full cache as a deployment holds it (fp16/bf16, see deployed())
            "kv_bytes_deployed": _mean([deployed(r)[0] for r in rs]),
            "kv_ratio": _mean([deployed(r)[0] / deployed(r)[1] for r in rs]),
            "kv_ratio_basis": "fp16" if all("kv_bytes_deployed" in r for r in rs) else "measured",
            "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
            # one-shot: the full cache exists while the context is prefilled; chunked: at most budget + chunk
            "peak_prefill_kv_bytes": max(_peak_prefill(r) for r in rs),
            "nominal_budget": _nominal(rs[0]),
            # samples whose context is shorter than the token budget: the variant kept everything there
            "budget_clipped": sum(bool(r.get("budget_clipped")) for r in rs),
            "kv_bytes_per_token": _mean([deployed(r)[0] / r["context_tokens"] for r in rs if r.get("context_tokens")]),
            # over the rows that carry one: a row without it is refused by the gate (evidence.judged_fields)
            **{k: _mean([r[k] for r in rs if r.get(k) is not None]) for k in FIDELITY if k in rs[0]},
            "splits": _grouped(rs, lambda r: r["cell"].get("split")),
            "cells": _grouped(rs, lambda r: cell_key(r["cell"])),
        }
    return out


def deployed(row: dict[str, Any]) -> tuple[int, int]:
    """(variant, full-cache baseline) KV bytes as a deployment holds them: dense keys and values in fp16/bf16, quantized
    ones packed (evalkit.kv.cache.deployed_bytes). Rows written before these were recorded: the measured bytes."""
    if row.get("kv_bytes_deployed") and row.get("kv_bytes_baseline_deployed"):
        return row["kv_bytes_deployed"], row["kv_bytes_baseline_deployed"]
    return row["kv_bytes"], row["kv_bytes_baseline"]


def _nominal(row: dict[str, Any]) -> float | None:
    """The budget a variant asked for as a share of the context (None for token budgets and the baseline)."""
    budget = (row.get("policy") or {}).get("budget")
    return float(budget) if isinstance(budget, float) else None


def _drop(p: dict[str, Any]) -> str:
    lo, hi = p["drop_bounds"]
    return f"{p['drop']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def format_summary(summary: dict[str, Any]) -> str:
    """The console table: variants, then each variant's per-cell accuracy beside the baseline's."""
    w = max([24, *(len(name) + 2 for name in summary)])
    head = (
        f"{'variant':<{w}}{'n':>5}{'baseline':>10}{'policy':>8}{'lost':>6}{'gained':>8}{'drop [95% bounds]':>22}"
        f"{'McNemar p':>11}{'KV measured':>14}{'ratio vs fp16':>15}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        lines.append(
            f"{name:<{w}}{s['n']:>5}{s['baseline_accuracy']:>10.2f}{s['accuracy']:>8.2f}{s['lost']:>6}"
            f"{s['gained']:>8}{_drop(s['paired']):>22}{s['paired']['mcnemar_p']:>11.3g}"
            f"{fmt_bytes(s['kv_bytes'], 'MiB'):>14}{s['kv_ratio']:>14.3f}x"
        )
    for name, s in summary.items():
        if s.get("budget_clipped"):
            lines.append(
                f"{name}: the budget exceeds the context of {s['budget_clipped']} of {s['n']} samples "
                "(budget_clipped): they kept every token"
            )
        if not is_baseline(name) and "kl_mean" in s:
            lines.append(
                f"{name}: mean KL {s['kl_mean']:.4f} nats, top-1 agreement {s['top1_agreement']:.3f}, "
                f"perplexity ratio {s['ppl_ratio']:.3f}"
            )
        if not is_baseline(name) and s["splits"]:
            parts = [f"{k} {v['baseline']:.2f} -> {v['policy']:.2f} (n={v['n']})" for k, v in s["splits"].items()]
            lines.append(f"{name}: " + " | ".join(parts))
    for name, s in summary.items():
        if is_baseline(name):
            continue
        lines += ["", f"{name}: accuracy per cell (baseline -> policy)"]
        lines += [
            f"  {cell:<50} {c['baseline']:.2f} -> {c['policy']:.2f}  (n={c['n']})" for cell, c in s["cells"].items()
        ]
    return "\n".join(lines)
