"""The exact first look: paired 0/1 scores, one question per context, a sample count fixed before any data.

A PASS there is today's Tango test with its exact floor (evalkit.stats) joined with the exact binomial test of the
flip rate and the `min_samples` floor. Its error rate is not taken on trust: for a given n the outcomes are the pairs
(b lost, c gained), and the chance that the test PASSes a variant whose drop sits at the margin is a finite sum over
them, maximised over the one unknown left (the gain rate; a variant with a larger drop is stochastically worse, so
the boundary is the worst case). `pass_size` computes it. Where Tango's statistic, an approximation, would exceed the
gate's level (at n = 69 the worst case is 5.11% at 5%), the exact size takes over; everywhere else the first look
gives today's numbers.

What the first look could spend, `spent`, is what later looks no longer have: they bet with the rest
(evalkit.betting), so the whole sequence of looks keeps the stated error rate, whatever sample counts they use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.stats import binom

from evalkit.gate.stats import binary_p

GRID = 401  # nuisance values on which the worst case is searched, then refined around the largest


@dataclass(frozen=True)
class Design:
    """The exact first look's test: n one-question contexts, the margins and the floor it judges at."""

    n: int
    margin: float | None  # gate.max_drop
    flip_limit: float | None  # gate.max_flip_rate
    floor: int  # gate.min_samples (resolved)

    def pass_p(self, b, c) -> np.ndarray:
        """The joint p-value of a PASS at every outcome (b lost, c gained): the larger of the drop's and the flip
        rate's (an intersection-union test), 1 below the floor."""
        p = np.zeros(np.broadcast(np.asarray(b), np.asarray(c)).shape)
        if self.margin is not None:
            p = np.maximum(p, binary_p(b, c, self.n, self.margin)[0])
        if self.flip_limit is not None:
            p = np.maximum(p, binom.cdf(b, self.n, self.flip_limit) + 0 * np.asarray(c))
        return np.where(self.n < self.floor, 1.0, p)

    def drop_fail_p(self, b, c) -> np.ndarray:
        return np.asarray(binary_p(b, c, self.n, self.margin)[1])


def edge(n: int, p_of, t: float, down: bool) -> np.ndarray:
    """Per gain count c = 0..n: the largest b with p(b, c) <= t (down: the region is b <= edge), -1 when none; or the
    smallest (up: b >= edge), n - c + 1 when none. A bisection over b for every c at once (p is monotone in b)."""
    c = np.arange(n + 1)
    lo, hi = (np.full(n + 1, -1), n - c) if down else (np.zeros(n + 1, dtype=int), n - c + 1)
    while np.any(lo < hi):
        mid = (lo + hi + 1) // 2 if down else (lo + hi) // 2
        ok = p_of(np.clip(mid, 0, n - c), c) <= t
        if down:
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
        else:
            lo, hi = np.where(ok, lo, mid + 1), np.where(ok, mid, hi)
    return lo


def chance(n: int, edge_: np.ndarray, p_lost, p_gained, down: bool) -> np.ndarray:
    """P((B, C) in the region) for multinomial (B, C) of n at these rates (arrays of rates: one chance each): the
    region is b <= edge[c] (down) or b >= edge[c]. C ~ Bin(n, p_gained), and B given C = c ~ Bin(n - c, p_lost /
    (1 - p_gained))."""
    c = np.arange(n + 1)
    g = np.atleast_1d(np.asarray(p_gained, dtype=float))[:, None]
    q = np.clip(np.atleast_1d(np.asarray(p_lost, dtype=float))[:, None] / np.maximum(1 - g, 1e-300), 0.0, 1.0)
    pc = binom.pmf(c, n, g)  # (G, n + 1)
    inside = binom.cdf(edge_, n - c, q) if down else binom.sf(edge_ - 1, n - c, q)
    return np.sum(pc * inside, axis=-1)


def worst(n: int, region: np.ndarray, lost_of, top: float, down: bool) -> float:
    """The largest chance of the region over the gain rates g in [0, top], the loss rate lost_of(g): a grid, then a
    bounded search between the grid's neighbours of its largest value."""
    if (down and np.all(region < 0)) or (not down and np.all(region > n - np.arange(n + 1))):
        return 0.0
    grid = np.linspace(0.0, top, GRID)
    values = chance(n, region, lost_of(grid), grid, down)
    i = int(np.argmax(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, GRID - 1)]
    res = minimize_scalar(
        lambda g: -float(chance(n, region, lost_of(g), g, down)[0]), bounds=(lo, hi), method="bounded"
    )
    return max(float(values[i]), -float(res.fun))


def pass_size(d: Design, t: float, null: str) -> float:
    """The worst-case chance that the joint PASS p-value is at most t, under "drop" (the drop at the margin) or
    "flips" (the loss rate at the flip limit)."""
    region = edge(d.n, d.pass_p, t, down=True)
    if null == "drop":
        m = d.margin
        return worst(d.n, region, lambda g: g + m, (1 - m) / 2, down=True)
    f = d.flip_limit
    return worst(d.n, region, lambda g: f + 0 * g, 1 - f, down=True)


def drop_fail_size(d: Design, t: float) -> float:
    """The worst-case chance that the drop's FAIL p-value is at most t when the drop sits at the margin."""
    region = edge(d.n, d.drop_fail_p, t, down=False)
    m = d.margin
    return worst(d.n, region, lambda g: g + m, (1 - m) / 2, down=False)


def corrected(p: float, size_at) -> float:
    """An exact p-value: the larger of p and the worst-case chance of a p-value at most p (today's p wherever the
    approximation keeps its level)."""
    return max(p, size_at(p)) if p < 1 else 1.0


def threshold(size_at, level: float) -> float:
    """The largest t <= level whose region keeps the worst case at or below level: what the corrected test rejects
    at `level` is exactly {p <= t}."""
    if size_at(level) <= level:
        return level
    lo, hi = 0.0, level
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if size_at(mid) <= level else (lo, mid)
    return lo


def pass_spent(d: Design, level: float) -> dict[str, float]:
    """What a PASS at this first look could have cost, per null: the worst-case chance of the corrected test's
    PASS at `level` with the drop at the margin ("drop") and with the loss rate at the flip limit ("flips")."""
    if d.n < d.floor:
        return {"drop": 0.0, "flips": 0.0}
    t = threshold(lambda x: pass_size(d, x, "drop"), level) if d.margin is not None else level
    out = {}
    if d.margin is not None:
        out["drop"] = pass_size(d, t, "drop")
    if d.flip_limit is not None:
        out["flips"] = pass_size(d, t, "flips")
    return out


def fail_spent(d: Design, level: float) -> dict[str, float]:
    """What a FAIL at this first look could have cost, per check, when the variant sits exactly at the limit."""
    out = {}
    if d.margin is not None:
        t = threshold(lambda x: drop_fail_size(d, x), level)
        out["drop"] = drop_fail_size(d, t)
    if d.flip_limit is not None:
        out["flips"] = binomial_spent(d.n, d.flip_limit, level, below=False)
    return out


def binomial_spent(n: int, p: float, level: float, below: bool) -> float:
    """The size of the exact one-sided binomial test at `level`: the largest tail probability at most level."""
    k = np.arange(n + 1)
    tails = binom.cdf(k, n, p) if below else binom.sf(k - 1, n, p)
    ok = tails[tails <= level]
    return float(ok.max()) if ok.size else 0.0


def power(d: Design, level: float, p_lost: float, p_gained: float, checked: bool = True) -> float:
    """The chance of a PASS at this first look when the policy loses and gains at these rates (exact enumeration
    over the multinomial of outcomes), the test corrected to its exact size where it needs it (checked=False skips
    that check, for a quick scan)."""
    if d.n < d.floor:
        return 0.0
    t = level
    if checked and d.margin is not None:
        t = threshold(lambda x: pass_size(d, x, "drop"), level)
    region = edge(d.n, d.pass_p, t, down=True)
    return float(chance(d.n, region, p_lost, p_gained, down=True)[0])
