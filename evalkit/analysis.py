"""Paired summaries of a run: every variant against the baseline on the same samples."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from evalkit.stats import flip_cause, mcnemar_exact, paired_bootstrap_ci

BASELINE = "baseline"
FIDELITY = ("kl_mean", "top1_agreement", "ppl_ratio")


def cell_key(cell: dict[str, Any]) -> str:
    return " ".join(f"{k}={cell[k]}" for k in sorted(cell))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def paired(baseline: list[float], policy: list[float]) -> dict[str, Any]:
    """Accuracies, flips, the accuracy drop with its paired bootstrap 95% CI, and McNemar's exact p-value."""
    lost = sum(p < b for b, p in zip(baseline, policy, strict=True))
    gained = sum(p > b for b, p in zip(baseline, policy, strict=True))
    lo, hi = paired_bootstrap_ci(baseline, policy)
    return {
        "n": len(policy),
        "baseline": _mean(baseline),
        "policy": _mean(policy),
        "lost": lost,
        "gained": gained,
        "drop": _mean(baseline) - _mean(policy),
        "drop_ci95": [lo, hi],
        "mcnemar_p": mcnemar_exact(lost, gained),
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
    for variant, rs in sorted(by_variant.items(), key=lambda kv: (kv[0] != BASELINE, kv[0])):
        overall = paired([r["baseline_score"] for r in rs], [r["score"] for r in rs])
        out[variant] = {
            "n": len(rs),
            "accuracy": overall["policy"],
            "baseline_accuracy": overall["baseline"],
            "lost": overall["lost"],
            "gained": overall["gained"],
            "paired": overall,
            "flip_causes": dict(Counter(c for c in map(flip_cause, rs) if c)),
            "kv_bytes": _mean([r["kv_bytes"] for r in rs]),
            "kv_bytes_baseline": _mean([r["kv_bytes_baseline"] for r in rs]),
            "kv_ratio": _mean([r["kv_bytes"] / r["kv_bytes_baseline"] for r in rs]),
            "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
            # the full cache exists while the context is prefilled, before any compression
            "peak_prefill_kv_bytes": max(r["kv_bytes_baseline"] for r in rs),
            "nominal_budget": _nominal(rs[0]),
            "kv_bytes_per_token": _mean([r["kv_bytes"] / r["context_tokens"] for r in rs if r.get("context_tokens")]),
            **{k: _mean([r[k] for r in rs]) for k in FIDELITY if k in rs[0]},
            "splits": _grouped(rs, lambda r: r["cell"].get("split")),
            "cells": _grouped(rs, lambda r: cell_key(r["cell"])),
        }
    return out


def _nominal(row: dict[str, Any]) -> float | None:
    """The budget a variant asked for as a share of the context (None for token budgets and the baseline)."""
    budget = (row.get("policy") or {}).get("budget")
    return float(budget) if isinstance(budget, float) else None


def capacity(summary: dict[str, Any], weights_bytes: int, gpu_gib: float, context: int) -> dict[str, Any]:
    """How many sequences of `context` tokens fit in `gpu_gib` of accelerator memory after the weights, per variant,
    from the KV bytes per context token measured in the run (in the dtype the run used)."""
    free = gpu_gib * 2**30 - weights_bytes
    out = {}
    for name, s in summary.items():
        per_seq = s["kv_bytes_per_token"] * context
        out[name] = {
            "kv_bytes_per_token": s["kv_bytes_per_token"],
            "kv_bytes_per_sequence": per_seq,
            "sequences": int(free // per_seq) if per_seq > 0 and free > 0 else 0,
        }
    return out


def _drop(p: dict[str, Any]) -> str:
    lo, hi = p["drop_ci95"]
    return f"{p['drop']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def format_summary(summary: dict[str, Any]) -> str:
    """The console table: variants, then each variant's per-cell accuracy beside the baseline's."""
    head = (
        f"{'variant':<24}{'n':>5}{'baseline':>10}{'policy':>8}{'lost':>6}{'gained':>8}{'drop [95% CI]':>22}"
        f"{'McNemar p':>11}{'KV held':>12}{'ratio':>8}"
    )
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        lines.append(
            f"{name:<24}{s['n']:>5}{s['baseline_accuracy']:>10.2f}{s['accuracy']:>8.2f}{s['lost']:>6}"
            f"{s['gained']:>8}{_drop(s['paired']):>22}{s['paired']['mcnemar_p']:>11.3g}"
            f"{s['kv_bytes'] / 2**20:>9.2f} MB{s['kv_ratio']:>7.3f}x"
        )
    for name, s in summary.items():
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
