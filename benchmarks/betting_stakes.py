"""Stakes that adapt to the outcomes seen so far: a design study for the gate's betting test (a benchmark; the
package is unchanged).

The gate shows "mean < target" for per-context values in [lo, hi] by betting (evalkit.stats.betting): the wealth
prod_i (1 + lam_i (target - x_i)) is a test supermartingale under H0: mean >= target whenever each lam_i lies in
[0, 1 / (hi - target)] and depends on x_1..x_{i-1} only (predictable), so by Ville's inequality it EVER reaches 20
with chance at most 5%. Today's lam is a fixed mixture of four constants (order-invariant). Here:

- `today`: evalkit's mixture (betting.log_factors / betting.mix), judged at the look's n (what the gate does);
- `today-max`: the same wealth, a PASS when any prefix of the fixed order reached 20 (the running maximum);
- `kelly(a, p0, c)`: a predictable Kelly plug-in: the log-optimal stake for the empirical distribution of values
  1..t-1 plus `a` pseudo-contexts (a share p0 of them at hi, the rest at 0: "a loss rate p0 seen a times"), at most
  c of the cap; judged by the running maximum;
- `agrapa(c)`: the approximate GRAPA plug-in of Waudby-Smith & Ramdas (2024, JRSS-B 86:1-27, section 5),
  (target - mu) / (var + (target - mu)^2) from a lightly regularised running mean and variance, at most c of the cap;
- `mix`: the average of two Kelly plug-ins' wealths (an average of test supermartingales is one).

Every candidate is judged on both checks of a one-question context: the drop (values -1, 0, 1, target 0.05) and
the flip rate (values 0, 1, target 0.10); a PASS needs both. Power: the first n whose PASS share over Monte Carlo
runs reaches 80% (the gate's planner reads the same for `today`: 74 / 134 / 205 / 484 / 258, exact). Error at a
margin: the share of runs that EVER PASS up to n = 2000, which bounds every pattern of looks over prefixes of one
order (kept, deleted, advised: each is a stopping time). MC standard errors are printed beside every rate.

    python benchmarks/betting_stakes.py [--quick] [--draws N] [--seed S]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from evalkit.stats import betting

ALPHA = 0.05
NEED = math.log(1 / ALPHA)
DROP = (0.05, -1.0, 1.0, (-1.0, 0.0, 1.0))  # target, lo, hi, the values a one-question context can take
FLIP = (0.10, 0.0, 1.0, (0.0, 1.0))
POWER_RATES = ((0.0, 0.0), (0.005, 0.0), (0.01, 0.0), (0.02, 0.0), (0.02, 0.02))
MARGIN_RATES = ((0.05, 0.0), (0.075, 0.025), (0.10, 0.06))  # drop at 0.05; drop at 0.05; flip rate at 0.10


class Today:
    """evalkit's constant mixture: the wealth does not depend on the order (its log factors come from the package)."""

    def __init__(self, running_max: bool):
        self.running_max = running_max
        self.name = "today-max" if running_max else "today"
        self.parts = 1

    def start(self, n: int, check) -> np.ndarray:
        return np.zeros((n, len(betting.BETS)))

    def step(self, logs: np.ndarray, counts: np.ndarray, x: np.ndarray, check) -> np.ndarray:
        target, lo, hi, _ = check
        return logs + betting.log_factors(x, target, lo, hi, True)

    def log_wealth(self, logs: np.ndarray) -> np.ndarray:
        return betting.mix(logs)


def kelly_fraction(values, weights, target: float, cap: float, iters: int = 30) -> np.ndarray:
    """The stake lam in [0, cap] maximising sum_k w_k log(1 + lam (target - v_k)) (weights (N, K) over the values
    (K,)): the root of sum_k w_k g_k / (1 + lam g_k), which falls with lam, by bisection (0 or cap at the ends)."""
    g = target - np.asarray(values, dtype=float)

    def slope(lam):
        return (weights * g / (1.0 + lam[:, None] * g)).sum(axis=1)

    n = weights.shape[0]
    lo, hi = np.zeros(n), np.full(n, cap)
    at_cap, none = slope(hi) >= 0, slope(lo) <= 0
    for _ in range(iters):
        mid = (lo + hi) / 2
        up = slope(mid) > 0
        lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
    return np.where(at_cap, cap, np.where(none, 0.0, lo))


class Plugin:
    """Predictable plug-in stakes, one or several (their wealths averaged): each step's stake uses the counts of the
    values seen before it only, and the verdict is the running maximum of the wealth over prefixes of the order."""

    def __init__(self, name: str, rules):
        self.name, self.rules, self.running_max, self.parts = name, rules, True, len(rules)

    def start(self, n: int, check) -> np.ndarray:
        return np.zeros((n, len(self.rules)))

    def stakes(self, counts: np.ndarray, check) -> np.ndarray:
        target, lo, hi, values = check
        cap = 1.0 / (hi - target)
        cols = []
        for kind, a, p0, c in self.rules:
            if kind == "kelly":  # a pseudo-contexts: a share p0 at hi, the rest at the value 0 ("nothing changed")
                prior = np.array([a * p0 if v == hi else (a * (1 - p0) if v == 0 else 0.0) for v in values])
                cols.append(kelly_fraction(values, counts + prior, target, c * cap))
            else:  # aGRAPA: regularised mean and variance (a pseudo-contexts at 0 with variance p0)
                v = np.asarray(values)
                n = counts.sum(axis=1) + a
                mu = (counts @ v) / n
                var = np.maximum((counts @ (v * v) + a * p0) / n - mu * mu, 1e-6)
                d = target - mu
                cols.append(np.clip(d / (var + d * d), 0.0, c * cap))
        return np.stack(cols, axis=1)

    def step(self, logs: np.ndarray, counts: np.ndarray, x: np.ndarray, check) -> np.ndarray:
        lam = self.stakes(counts, check)  # from values 1..t-1: counts is updated after this step
        target = check[0]
        with np.errstate(divide="ignore"):
            return logs + np.log(np.maximum(1.0 + lam * (target - x)[:, None], 0.0))

    def log_wealth(self, logs: np.ndarray) -> np.ndarray:
        return betting.mix(logs)
