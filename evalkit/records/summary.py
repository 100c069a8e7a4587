"""A run's paired summary (summary.json and the console table): every variant against the baseline on the same
samples, per variant and per cell."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from evalkit.records.merged import is_baseline, label_order
from evalkit.records.schema import BASELINE, Row, flip_cause
from evalkit.stats import mcnemar_exact, paired_drop
from evalkit.thresholds import Thresholds
from evalkit.units import fmt_bytes

FIDELITY = ("kl_mean", "top1_agreement", "ppl_ratio")


def peak_prefill(row: Row) -> int:
    """The most KV bytes held while the context was prefilled (rows written before chunked prefill: the baseline's)."""
    return row.get("prefill_peak_kv_bytes") or row["kv_bytes_baseline"]


def cell_key(cell: dict[str, Any]) -> str:
    return " ".join(f"{k}={cell[k]}" for k in sorted(cell))


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def paired(baseline: list[float], policy: list[float], level: float = 0.95) -> dict[str, Any]:
    """Accuracies, flips, the accuracy drop with its one-sided bounds at `level` (evalkit.stats: Tango's score
    interval for 0/1 scores, BCa bootstrap for graded ones), and McNemar's exact p-value."""
    p = paired_drop(baseline, policy, level)
    return {
        "n": p.n,
        "baseline": mean(baseline),
        "policy": mean(policy),
        "lost": p.lost,
        "gained": p.gained,
        "drop": p.drop,
        "drop_bounds": [p.lower, p.upper],  # one-sided at `level` each
        "level": level,
        "method": p.method,
        "mcnemar_p": mcnemar_exact(p.lost, p.gained),
    }


def _grouped(rows: list[Row], key) -> dict[str, dict[str, Any]]:
    """Paired statistics per group of rows (key(row) -> group name, None to leave a row out)."""
    groups: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for r in rows:
        k = key(r)
        if k is not None:
            groups[k][0].append(r.baseline_score)
            groups[k][1].append(r.score)
    return {k: paired(b, p) for k, (b, p) in sorted(groups.items())}


def run_order(label: str) -> tuple:
    """Sort key of one run's variant labels: the baseline first, then the variants by name."""
    return label != BASELINE, label


def summarize(rows: list[Row], order: Callable[[str], Any] = run_order) -> dict[str, Any]:
    """Per variant: accuracy beside the baseline's on the same samples, flips, KV bytes; and per cell. Variants in
    `order` (merged runs' labels: the gate's label_order)."""
    by_variant: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_variant[r.variant].append(r)
    out = {}
    for variant, rs in sorted(by_variant.items(), key=lambda kv: order(kv[0])):
        overall = paired([r.baseline_score for r in rs], [r.score for r in rs])
        out[variant] = {
            "n": len(rs),
            "accuracy": overall["policy"],
            "baseline_accuracy": overall["baseline"],
            "lost": overall["lost"],
            "gained": overall["gained"],
            "paired": overall,
            "flip_causes": dict(Counter(c for c in map(flip_cause, rs) if c)),
            # measured: in the dtype the model ran in here (float32 on the CPU)
            "kv_bytes": mean([r["kv_bytes"] for r in rs]),
            "kv_bytes_baseline": mean([r["kv_bytes_baseline"] for r in rs]),
            "kv_ratio_measured": mean([r["kv_bytes"] / r["kv_bytes_baseline"] for r in rs]),
            # judged and planned: the cache each answer was decoded from at its largest (the compressed context, the
            # question, the answer) against the baseline's, both as a deployment holds them (fp16/bf16, decoded())
            "kv_bytes_deployed": mean([decoded(r)[0] for r in rs]),
            "kv_ratio": mean([decoded(r)[0] / decoded(r)[1] for r in rs]),
            "kv_ratio_basis": _basis(rs),
            # the context alone right after compression: a second figure, never the one judged
            "kv_bytes_context_deployed": mean([deployed(r)[0] for r in rs]),
            "kv_ratio_context": mean([deployed(r)[0] / deployed(r)[1] for r in rs]),
            "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
            # one-shot: the full cache exists while the context is prefilled; chunked: at most budget + chunk
            "peak_prefill_kv_bytes": max(peak_prefill(r) for r in rs),
            "nominal_budget": _nominal(rs[0]),
            # samples whose context is shorter than the token budget: the variant kept everything there
            "budget_clipped": sum(bool(r.get("budget_clipped")) for r in rs),
            # per context token of the compressed context: a rate the capacity multiplies by a context length
            "kv_bytes_per_token": mean([deployed(r)[0] / r["context_tokens"] for r in rs if r.get("context_tokens")]),
            # over the rows that carry one: a row without it is refused by the gate (evidence.judged_fields)
            **{k: mean([r[k] for r in rs if r.get(k) is not None]) for k in FIDELITY if k in rs[0]},
            "splits": _grouped(rs, lambda r: r.cell.get("split")),
            "cells": _grouped(rs, lambda r: cell_key(r.cell)),
        }
    return out


def decoded(row: Row) -> tuple[int, int]:
    """(variant, full-cache baseline) KV bytes of the cache the answer was decoded from, at its largest, as a
    deployment holds them; rows without them (refused by the gate: evalkit.records.evidence) fall back to deployed()."""
    if row.get("decode_peak_kv_bytes_deployed") and row.get("decode_peak_kv_bytes_baseline_deployed"):
        return row["decode_peak_kv_bytes_deployed"], row["decode_peak_kv_bytes_baseline_deployed"]
    return deployed(row)


def _basis(rows: list[Row]) -> str:
    """What a summary's kv_ratio counts bytes in: as deployed (fp16/bf16 dense, quantized packed), or as measured
    here (rows written before deployed bytes were recorded)."""
    return "fp16" if all("kv_bytes_deployed" in r for r in rows) else "measured"


def deployed(row: Row) -> tuple[int, int]:
    """(variant, full-cache baseline) KV bytes as a deployment holds them: dense keys and values in fp16/bf16, quantized
    ones packed (evalkit.kv.cache.deployed_bytes). Rows written before these were recorded: the measured bytes."""
    if row.get("kv_bytes_deployed") and row.get("kv_bytes_baseline_deployed"):
        return row["kv_bytes_deployed"], row["kv_bytes_baseline_deployed"]
    return row["kv_bytes"], row["kv_bytes_baseline"]


def _nominal(row: Row) -> float | None:
    """The budget a variant asked for as a share of the context (None for token budgets and the baseline)."""
    budget = (row.get("policy") or {}).get("budget")
    return float(budget) if isinstance(budget, float) else None


def _drop(p: dict[str, Any]) -> str:
    lo, hi = p["drop_bounds"]
    return f"{p['drop']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def format_summary(summary: dict[str, Any]) -> str:
    """The console table of one run's summary: variants, then each variant's per-cell accuracy beside the
    baseline's."""
    w = max([24, *(len(name) + 2 for name in summary)])
    head = (
        f"{'variant':<{w}}{'n':>5}{'baseline':>10}{'policy':>8}{'lost':>6}{'gained':>8}{'drop [95% descriptive]':>25}"
        f"{'McNemar p':>11}{'KV measured':>14}{'ratio vs fp16':>15}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        lines.append(
            f"{name:<{w}}{s['n']:>5}{s['baseline_accuracy']:>10.2f}{s['accuracy']:>8.2f}{s['lost']:>6}"
            f"{s['gained']:>8}{_drop(s['paired']):>25}{s['paired']['mcnemar_p']:>11.3g}"
            f"{fmt_bytes(s['kv_bytes'], 'MiB'):>14}{s['kv_ratio']:>14.3f}x"
        )
    for name, s in summary.items():
        if s.get("budget_clipped"):
            lines.append(
                f"{name}: the budget exceeds the context of {s['budget_clipped']} of {s['n']} samples "
                "(budget_clipped): they kept every token"
            )
        if name != BASELINE and "kl_mean" in s:
            lines.append(
                f"{name}: mean KL {s['kl_mean']:.4f} nats, top-1 agreement {s['top1_agreement']:.3f}, "
                f"perplexity ratio {s['ppl_ratio']:.3f}"
            )
        if name != BASELINE and s["splits"]:
            parts = [f"{k} {v['baseline']:.2f} -> {v['policy']:.2f} (n={v['n']})" for k, v in s["splits"].items()]
            lines.append(f"{name}: " + " | ".join(parts))
    for name, s in summary.items():
        if name == BASELINE:
            continue
        lines += ["", f"{name}: accuracy per cell (baseline -> policy)"]
        lines += [
            f"  {cell:<50} {c['baseline']:.2f} -> {c['policy']:.2f}  (n={c['n']})" for cell, c in s["cells"].items()
        ]
    return "\n".join(lines)


def baseline_problems(summary: dict[str, Any], t: Thresholds) -> tuple[list[str], list[str]]:
    """A baseline below min_baseline_accuracy (cannot judge), and the cells where it is (not judged)."""
    if t.min_baseline_accuracy is None:
        return [], []
    problems, cells = [], []
    for name, s in summary.items():
        if not is_baseline(name):
            continue
        of = "" if name == BASELINE else f" ({name})"
        if s["accuracy"] < t.min_baseline_accuracy:
            problems.append(
                f"the full-cache baseline{of} scores {s['accuracy']:.2f} on this task (gate.min_baseline_accuracy is "
                f"{t.min_baseline_accuracy}): nothing can be learned about the policy; use a stronger model or an "
                "easier task"
            )
            continue
        cells += [
            f"cell {cell}{of}: the baseline scores {c['baseline']:.2f} there, below {t.min_baseline_accuracy}"
            for cell, c in s["cells"].items()
            if c["baseline"] < t.min_baseline_accuracy
        ]
    return problems, cells


def chunked_vs_oneshot(rows: list[Row]) -> list[dict[str, Any]]:
    """Each chunked variant (`h2o@1024:chunk512`) beside the same policy prefilled in one shot (`h2o@1024`), paired
    on the samples both ran: accuracies, chunked minus one-shot with its 95% CI, and the peak KV bytes of each."""
    by_label: dict[str, dict[str, Row]] = defaultdict(dict)
    for r in rows:
        by_label[r.variant][r.sample_id] = r
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
        stats = paired([base[i].score for i in ids], [chunked[i].score for i in ids])
        out.append(
            {
                "variant": name,
                "chunk": chunk,
                "n": len(ids),
                "baseline": mean([base[i].baseline_score for i in ids]),
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
