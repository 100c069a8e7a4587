"""Paired statistics for a variant against the baseline on the same samples: Tango's score test and bounds for 0/1
scores, the exact Clopper-Pearson bound, BCa where it holds, Holm's correction.

The quantity judged is the accuracy drop, mean(baseline score - policy score) over paired samples. Bounds are
one-sided at `level` (0.95: the drop is below the upper bound with 95% confidence), the form a non-inferiority
decision needs; `bounds(...)[0]` and `[1]` together are a two-sided interval at 2 * level - 1.

- 0/1 scores: Tango's score interval for the difference of paired proportions (Tango 1998, Stat Med 17:891-908;
  recommended by Fagerland, Lydersen and Laake 2013, BMC Med Res Methodol 13:91). It needs only the discordant
  counts: b samples lost (baseline right, policy wrong), c gained, of n. When no sample gained, the upper bound is at
  least the exact Clopper-Pearson bound on the loss rate (the drop cannot exceed the loss rate), where the score
  interval alone undercovers: 0 lost of n gives 1 - alpha**(1/n), so 0 of 20 bounds the drop at 0.139 and "below
  0.05" needs 59 samples.
- graded scores (F1, agreement): the BCa bootstrap (Efron 1987, JASA 82:171-185; Efron and Tibshirani 1993, sec.
  14.3) of the mean difference only where it holds, from BCA_SAMPLES samples of which BCA_NONZERO differ (at 20
  samples with 69% ties its upper bound falls below the true drop 26.6% of the time); elsewhere the bounded-mean
  bound of stats.betting, which needs no more than scores in [0, 1] (a uniform drop of 0.04 is bounded, where the
  bootstrap collapses to a point).

These are the per-sample figures of summaries and reports; the gate judges contexts by betting (evalkit.gate.checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import brentq
from scipy.stats import beta, binomtest, norm

from evalkit.stats import betting

BOOTSTRAP_ITERS = 9_999
BOOTSTRAP_BATCH_ELEMENTS = 1 << 22  # resampled indices held at once (32 MiB of int64), whatever n
BCA_SAMPLES = 100  # BCa's one-sided bounds keep their level from about here (4.9% at 100 samples with 69% ties)...
BCA_NONZERO = 30  # ...and this many pairs that differ; below either, the betting bound
MULTIPLICITY = ("holm", "bonferroni", "none")


def is_binary(*scores: list[float]) -> bool:
    return all(s in (0, 1) for xs in scores for s in xs)


# --- 0/1 scores: Tango's score statistic -------------------------------------------------------------------------


def tango_z(b, c, n: int, delta: float):
    """Tango's score statistic for H0: drop = delta, with b lost and c gained of n pairs; decreasing in delta. b and c
    may be arrays.

    z = (b - c - n delta) / sqrt(n (2 p21 + delta (1 - delta))), p21 the gain probability's maximum-likelihood
    estimate under H0: the root of 2n p^2 + B p + C, B = -b - c + (2n - b + c) delta, C = -c delta (1 - delta)."""
    b, c = np.asarray(b, dtype=float), np.asarray(c, dtype=float)
    big_b = -b - c + (2 * n - b + c) * delta
    big_c = -c * delta * (1 - delta)
    p21 = (np.sqrt(np.maximum(big_b * big_b - 8 * n * big_c, 0.0)) - big_b) / (4 * n)
    var = n * (2 * p21 + delta * (1 - delta))
    diff = b - c - n * delta
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(var > 0, diff / np.sqrt(np.where(var > 0, var, 1.0)), np.sign(diff) * np.inf)
    z = np.where((var <= 0) & (diff == 0), 0.0, z)
    return float(z) if z.ndim == 0 else z


def _tango_bound(b: int, c: int, n: int, z: float, upper: bool) -> float:
    """The delta where Tango's statistic crosses -z (upper bound) or +z (lower bound)."""
    est, eps = (b - c) / n, 1e-12
    target = -z if upper else z
    end = 1 - eps if upper else -1 + eps
    f = lambda d: tango_z(b, c, n, d) - target  # noqa: E731
    if (f(end) > 0) if upper else (f(end) < 0):
        return 1.0 if upper else -1.0
    lo, hi = (est, end) if upper else (end, est)
    return brentq(f, lo, hi, xtol=1e-10)


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """Exact one-sided upper bound of a binomial proportion, k successes of n."""
    return 1.0 if k >= n else float(beta.ppf(1 - alpha, k + 1, n - k))


def binary_bounds(b: int, c: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """One-sided (lower, upper) bounds on the drop at `level` each, from b lost and c gained of n."""
    z = norm.ppf(level)
    lower, upper = _tango_bound(b, c, n, z, False), _tango_bound(b, c, n, z, True)
    alpha = 1 - level
    # the drop is at most the loss rate: its exact lower bound caps the drop's, whatever gained (with no gain it is
    # the drop's own; with gains only rarely the smaller, but then more gains never make a FAIL easier)
    lower = min(lower, 1 - clopper_pearson_upper(n - b, n, alpha))
    if c == 0:  # no gains: the drop is the loss rate, bounded exactly
        upper = max(upper, clopper_pearson_upper(b, n, alpha))
    if b == 0:  # no losses: the same for the gain rate, mirrored
        lower = min(lower, -clopper_pearson_upper(c, n, alpha))
        upper = max(upper, clopper_pearson_upper(n - c, n, alpha) - 1)
    return lower, upper


# --- graded scores: BCa bootstrap -------------------------------------------------------------------------------


def _bootstrap_means(diff: np.ndarray, iters: int, seed: int) -> np.ndarray:
    rng, n = np.random.default_rng(seed), diff.size
    batch = max(1, BOOTSTRAP_BATCH_ELEMENTS // n)
    out = np.empty(iters)
    for start in range(0, iters, batch):
        k = min(batch, iters - start)
        out[start : start + k] = diff[rng.integers(0, n, size=(k, n))].mean(axis=1)
    return out


@dataclass
class BCa:
    """The BCa bootstrap of a mean: bias correction z0 and acceleration a (jackknife), over `means`."""

    means: np.ndarray
    z0: float
    a: float

    @classmethod
    def of(cls, diff: np.ndarray, iters: int = BOOTSTRAP_ITERS, seed: int = 0) -> BCa:
        means = _bootstrap_means(diff, iters, seed)
        z0 = norm.ppf((np.sum(means < diff.mean()) + 0.5 * np.sum(means == diff.mean())) / iters)
        jack = (diff.sum() - diff) / (diff.size - 1)
        d = jack.mean() - jack
        a = float(np.sum(d**3) / (6 * np.sum(d**2) ** 1.5))
        return cls(means, float(z0), a)

    def bound(self, level: float, upper: bool) -> float:
        z = norm.ppf(level if upper else 1 - level)
        q = norm.cdf(self.z0 + (self.z0 + z) / (1 - self.a * (self.z0 + z)))
        return float(np.quantile(self.means, q))

    def p_below(self, margin: float) -> float:
        """The smallest alpha at which the upper bound at 1 - alpha is below `margin`: the BCa mapping inverted."""
        share = (np.sum(self.means < margin) + 0.5 * np.sum(self.means == margin)) / self.means.size
        share = min(max(share, 0.5 / self.means.size), 1 - 0.5 / self.means.size)
        w = norm.ppf(share) - self.z0
        return float(norm.sf(w / (1 + self.a * w) - self.z0))


# --- one entry point ---------------------------------------------------------------------------------------------


@dataclass
class Paired:
    """The drop of one variant against the baseline on n paired samples, with one-sided bounds at `level`."""

    n: int
    lost: int
    gained: int
    drop: float
    lower: float
    upper: float
    method: str  # tango-score, bca-bootstrap, betting, or none (no samples)
    level: float
    bca: BCa | None = field(default=None, repr=False, compare=False)  # the bootstrap behind bca-bootstrap bounds


def paired_drop(baseline: list[float], policy: list[float], level: float = 0.95) -> Paired:
    """The drop and its one-sided bounds at `level`, by the method the scores call for (module docstring)."""
    base, pol = np.asarray(baseline, dtype=float), np.asarray(policy, dtype=float)
    diff = base - pol
    n, lost, gained = diff.size, int(np.sum(diff > 0)), int(np.sum(diff < 0))
    if n == 0:
        return Paired(0, 0, 0, math.nan, math.nan, math.nan, "none", level)
    drop = float(diff.mean())
    if is_binary(baseline, policy):
        lo, hi = binary_bounds(lost, gained, n, level)
        return Paired(n, lost, gained, drop, lo, hi, "tango-score", level)
    if n >= BCA_SAMPLES and lost + gained >= BCA_NONZERO and np.ptp(diff) > 1e-9:  # the bootstrap needs a spread
        bca = BCa.of(diff)
        lo, hi = bca.bound(level, False), bca.bound(level, True)
        return Paired(n, lost, gained, drop, lo, hi, "bca-bootstrap", level, bca)
    lo = betting.bound(diff, 1 - level, -1.0, 1.0, upper=False)
    hi = betting.bound(diff, 1 - level, -1.0, 1.0, upper=True)
    return Paired(n, lost, gained, drop, lo, hi, "betting", level)


def adjust(pvalues: list[float], alpha: float, method: str) -> list[bool]:
    """Which hypotheses are rejected with the family-wise error rate held at alpha (Holm's step-down, or
    statsmodels' Bonferroni), or each at alpha with `none`. NaN p-values are never rejected and do not count in the
    family."""
    if method not in MULTIPLICITY:
        raise ValueError(f"multiplicity={method!r} is not one of {list(MULTIPLICITY)}")
    idx = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    reject = [False] * len(pvalues)
    if not idx:
        return reject
    family = np.array([pvalues[i] for i in idx], dtype=float)
    if method == "none":
        flags = family < alpha
    elif method == "holm":
        flags = holm(family, alpha)
    else:
        from statsmodels.stats.multitest import multipletests

        flags = multipletests(family, alpha=alpha, method=method)[0]
    for i, f in zip(idx, flags, strict=True):
        reject[i] = bool(f)
    return reject


def holm(pvalues: np.ndarray, alpha: float) -> np.ndarray:
    """Holm's step-down: the k-th smallest p-value (k from 0) is rejected while it and every smaller one are at most
    alpha / (m - k). statsmodels' multipletests(method="holm") decides the same (tests/test_stats.py checks it) but
    runs a full garbage collection on every call: 0.3 s in a process holding a model, once per family per look."""
    order = np.argsort(pvalues, kind="stable")
    ok = np.logical_and.accumulate(pvalues[order] <= alpha / np.arange(len(pvalues), 0, -1))
    out = np.zeros(len(pvalues), dtype=bool)
    out[order] = ok
    return out


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p-value: the discordant pairs against a fair coin."""
    n = lost + gained
    return 1.0 if n == 0 else float(binomtest(lost, n, 0.5).pvalue)
