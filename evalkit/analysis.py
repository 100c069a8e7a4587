"""Paired summaries of a run: every variant against the baseline on the same samples."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

BASELINE = "baseline"
FIDELITY = ("kl_mean", "top1_agreement", "ppl_ratio")


def cell_key(cell: dict[str, Any]) -> str:
    return " ".join(f"{k}={cell[k]}" for k in sorted(cell))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: accuracy beside the baseline's on the same samples, flips, KV bytes; and per cell."""
    by_variant: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_variant[r["variant"]].append(r)
    out = {}
    for variant, rs in sorted(by_variant.items(), key=lambda kv: (kv[0] != BASELINE, kv[0])):
        cells: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"baseline": [], "policy": []})
        for r in rs:
            cells[cell_key(r["cell"])]["baseline"].append(r["baseline_score"])
            cells[cell_key(r["cell"])]["policy"].append(r["score"])
        splits: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"baseline": [], "policy": []})
        for r in rs:
            if "split" in r["cell"]:
                splits[r["cell"]["split"]]["baseline"].append(r["baseline_score"])
                splits[r["cell"]["split"]]["policy"].append(r["score"])
        out[variant] = {
            "n": len(rs),
            "accuracy": _mean([r["score"] for r in rs]),
            "baseline_accuracy": _mean([r["baseline_score"] for r in rs]),
            "lost": sum(r["flip"] == "lost" for r in rs),
            "gained": sum(r["flip"] == "gained" for r in rs),
            "kv_bytes": _mean([r["kv_bytes"] for r in rs]),
            "kv_bytes_baseline": _mean([r["kv_bytes_baseline"] for r in rs]),
            "kv_ratio": _mean([r["kv_bytes"] / r["kv_bytes_baseline"] for r in rs]),
            "peak_kv_bytes": max(r["peak_kv_bytes"] for r in rs),
            **{k: _mean([r[k] for r in rs]) for k in FIDELITY if k in rs[0]},
            "splits": {
                k: {"n": len(v["policy"]), "baseline": _mean(v["baseline"]), "policy": _mean(v["policy"])}
                for k, v in sorted(splits.items())
            },
            "cells": {
                k: {"n": len(v["policy"]), "baseline": _mean(v["baseline"]), "policy": _mean(v["policy"])}
                for k, v in sorted(cells.items())
            },
        }
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The console table: variants, then each variant's per-cell accuracy beside the baseline's."""
    head = f"{'variant':<24}{'n':>5}{'baseline':>10}{'policy':>8}{'lost':>6}{'gained':>8}{'KV held':>12}{'ratio':>8}"
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        lines.append(
            f"{name:<24}{s['n']:>5}{s['baseline_accuracy']:>10.2f}{s['accuracy']:>8.2f}{s['lost']:>6}"
            f"{s['gained']:>8}{s['kv_bytes'] / 2**20:>9.2f} MB{s['kv_ratio']:>7.3f}x"
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
