"""Anytime-valid tests and confidence bounds for the mean of bounded values, by betting.

Testing H0: mean >= target for values x_1, x_2, ... in [lo, hi] (independent, identically distributed: one value per
context), a bettor who stakes a fixed fraction lam of her wealth on each value being below the target grows it by
the factor 1 + lam (target - x). Under H0 every factor has expectation at most 1, so the wealth is a nonnegative
supermartingale, and by Ville's inequality it ever reaches 1/alpha with probability at most alpha: at every sample
count, however many looks and whenever they are taken (Waudby-Smith and Ramdas 2023, "Estimating means of bounded
random variables by betting", JRSS B 86:1-27, sections 3-5; Ramdas et al. 2023, "Game-theoretic statistics and
safe anytime-valid inference", Stat Sci 38:576-601). The bet must keep every factor nonnegative: lam <= 1 / (hi -
target).

evalkit bets a fixed mixture of constant fractions theta of that cap (BETS, weighed alike): an average of test
supermartingales is one, and a constant bet makes the wealth a function of the values alone, not of their order,
so the verdict does not depend on how rows or run folders are ordered. The fractions favour bold bets, which win
fastest when a policy loses little: with no loss at all, the margin 0.05 is shown after 74 one-question contexts
at 95% (a test judged once, at a count fixed before any data, would need 59; the 15 more buy every later look).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm

BETS = (1.0, 0.8, 0.6, 0.4)  # fractions of the largest bet that keeps the wealth nonnegative, weighed alike
# The KL checks' FAIL side bets on values with a long right tail (most rows near 0, a few far above the limit): a bold
# bet "above" loses most of its stake on every small row, so the mixture also holds small fractions, halving down to
# 1/64 (at twice max_mean_kl with 6% of rows at 3 nats, BETS alone never FAILed from 300 documents)
TAIL_BETS = tuple(0.5**i for i in range(7))
_EPS = 1e-12


def _factors(
    x: np.ndarray, target: float, lo: float, hi: float, below: bool, bets=BETS
) -> tuple[np.ndarray, np.ndarray]:
    """The per-value gain target - x (below) or x - target (above), and each bet's lam, shaped (..., n) and (J,).
    Betting above needs no upper end (hi may be inf): a factor 1 + lam (x - target) >= 0 for every x >= lo."""
    gain = (target - x) if below else (x - target)
    room = (hi - target) if below else (target - lo)
    lam = np.asarray(bets) / max(room, _EPS)
    return gain, lam


def log_wealth(x, target: float, lo: float, hi: float, below: bool = True, bets=BETS) -> np.ndarray:
    """Log of the mixture wealth after betting on every value of `x` (last axis; leading axes are batches).

    below=True bets that the mean is below `target` (its wealth is an e-value against H0: mean >= target);
    below=False bets that it is above. Values are clipped to [lo, hi]: callers pass values that lie there."""
    return mix(log_factors(x, target, lo, hi, below, bets).sum(axis=-2))


def log_wealth_path(x, target: float, lo: float, hi: float, below: bool = True) -> np.ndarray:
    """log_wealth after each value in turn, shaped like x: a run extended one context at a time."""
    return mix(np.cumsum(log_factors(x, target, lo, hi, below), axis=-2))


def log_factors(x, target: float, lo: float, hi: float, below: bool, bets=BETS) -> np.ndarray:
    """log(1 + lam_j gain_i), shaped (..., n, J); -inf where a bet loses everything."""
    x = np.clip(np.asarray(x, dtype=float), lo, hi)
    gain, lam = _factors(x, target, lo, hi, below, bets)
    with np.errstate(divide="ignore"):
        return np.log(np.maximum(1.0 + gain[..., None] * lam, 0.0))


def mix(logs: np.ndarray) -> np.ndarray:
    """The mixture over the bets (last axis) of log wealths, each weighed alike: log sum_j exp(logs_j) / J."""
    logs = logs - math.log(logs.shape[-1])
    top = logs.max(axis=-1)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(logs - safe[..., None]).sum(axis=-1))


def log_wealth_counts(counts, values, target: float, lo: float, hi: float, below: bool = True, bets=BETS) -> np.ndarray:
    """log_wealth for data given as counts of each distinct value: counts (..., V) of values (V,). The same number,
    in time independent of the sample count (the simulation and the planner use it)."""
    values = np.clip(np.asarray(values, dtype=float), lo, hi)
    gain, lam = _factors(values, target, lo, hi, below, bets)
    with np.errstate(divide="ignore"):
        per_value = np.log(np.maximum(1.0 + gain[:, None] * lam, 0.0))  # (V, J)
    counts = np.asarray(counts, dtype=float)[..., :, None]
    with np.errstate(invalid="ignore"):  # 0 * log(0) is 0: a value never seen does not zero a bet
        logs = np.where(counts > 0, counts * per_value, 0.0).sum(axis=-2)
    return mix(logs)


def p_value(x, target: float, lo: float, hi: float, below: bool = True, bets=BETS) -> float:
    """An anytime-valid p-value: 1 / wealth (at most 1)."""
    lw = float(log_wealth(x, target, lo, hi, below, bets))
    return math.exp(-lw) if lw > 0 else 1.0


def bound(x, budget: float, lo: float, hi: float, upper: bool = True, bets=BETS) -> float:
    """The confidence bound on the mean at error `budget` (anytime-valid): the upper bound is the smallest target that
    the bet "below target" rejects (its wealth reaches 1 / budget); the lower bound mirrors it. The wealth grows with
    the target, so a bisection finds it."""
    x = np.clip(np.asarray(x, dtype=float), lo, hi)
    if budget <= 0 or x.size == 0:
        return hi if upper else lo
    need = math.log(1 / budget)
    mean = float(x.mean())
    a, b = (mean, hi) if upper else (lo, mean)

    def rejects(t: float) -> bool:
        return float(log_wealth(x, t, lo, hi, upper, bets)) >= need

    if upper and not rejects(hi - _EPS):
        return hi
    if not upper and not rejects(lo + _EPS):
        return lo
    for _ in range(60):
        mid = (a + b) / 2
        if rejects(mid) == upper:
            b = mid
        else:
            a = mid
    return b if upper else a


def contexts_to_show(
    values: np.ndarray, target: float, lo: float, hi: float, budget: float, power: float, limit: int = 20_000
) -> float:
    """About how many contexts drawn like `values` make the bet "below target" reach 1 / budget with chance `power`
    (inf when the values do not favour it, or it takes over `limit`): each bet's log wealth after n contexts is about
    n G - z S sqrt(n) at that chance (G, S: mean and spread of its log factors over `values`; a normal
    approximation, exact when every value is the same), and the mixture's is their weighted log-sum."""
    x = np.clip(np.asarray(values, dtype=float), lo, hi)
    if x.size == 0:
        return math.inf
    logs = log_factors(x, target, lo, hi, below=True)  # (n, J)
    alive = np.all(np.isfinite(logs), axis=0)
    safe = np.where(alive, logs, 0.0)
    n = growth_to_show(safe.mean(axis=0), safe.std(axis=0), alive, np.asarray(budget, dtype=float), power, limit)
    return float(n)


def growth_to_show(g, s, alive, budget, power: float, limit: int = 20_000) -> np.ndarray:
    """contexts_to_show from each bet's mean g and spread s of log factors, shaped (..., J) (batches of runs;
    `alive`: the bets no value seen zeroes). The smallest n whose approximate mixture wealth reaches 1 / budget, by
    a bisection (below it the wealth stays short: it first dips, while the spread outweighs the growth, then rises)."""
    z = float(norm.ppf(power))
    need = np.log(1 / np.maximum(budget, 1e-300))

    def short(n):
        w = n[..., None] * g - z * s * np.sqrt(n[..., None])  # (..., J) each bet's log wealth at that chance
        return mix(np.where(alive, w, -np.inf)) < need

    lo = np.ones(np.shape(g)[:-1])
    hi = np.full(np.shape(g)[:-1], float(limit))
    never = short(hi) | (budget <= 0) | ~np.any(alive, axis=-1)
    while np.any(hi - lo > 0.5):
        mid = np.floor((lo + hi) / 2)
        below = short(mid)
        lo, hi = np.where(below, mid + 1, lo), np.where(below, hi, mid)
    return np.where(never, np.inf, hi)
