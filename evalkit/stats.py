"""Paired statistics for a variant against the baseline on the same samples."""

from __future__ import annotations

import numpy as np
from scipy.stats import binomtest

BOOTSTRAP_ITERS = 10_000


def paired_bootstrap_ci(
    baseline: list[float], policy: list[float], level: float = 0.95, seed: int = 0, iters: int = BOOTSTRAP_ITERS
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean accuracy drop (baseline - policy), resampling samples as pairs."""
    diff = np.asarray(baseline, dtype=float) - np.asarray(policy, dtype=float)
    if diff.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(iters, diff.size))].mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs against a fair coin."""
    n = lost + gained
    return 1.0 if n == 0 else float(binomtest(lost, n, 0.5).pvalue)


def flip_cause(row: dict, evicted_below: float = 0.5) -> str | None:
    """For a lost sample of a retrieval task: `evicted` when the evidence is held in fewer than half the layers'
    worth of its tokens (mean retention below `evicted_below`), else `ignored` (kept, yet the answer is wrong)."""
    retained = row.get("evidence_retained_per_layer")
    if row.get("flip") != "lost" or not retained:
        return None
    return "evicted" if sum(retained) / len(retained) < evicted_below else "ignored"
