"""The evidence on one variant: for each criterion (the accuracy drop, the flip rate, the capped mean KL and the share
of KL rows above the cap) a p-value for "holds"
(a PASS needs every one: an intersection-union test) and one for "broken" (a FAIL), with the bounds they agree with.

Every judgement, the first included, is the anytime-valid betting test of evalkit.stats.betting on the per-context means
(docs/gate-statistics.md): its bets are constant, so the wealth over nested prefixes of the same contexts is one
supermartingale, and judging again (after more samples, in a fresh folder, from a report or a CI job) adds no error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from evalkit.gate.contexts import KL_CAP_FACTOR, Contexts
from evalkit.stats import betting


@dataclass
class Check:
    """One criterion of one variant."""

    what: str  # drop, flips, kl (the capped mean KL), kl_tail (the share of KL rows above the cap)
    limit: float
    p_holds: float  # small: shown within the limit
    p_broken: float  # small: shown beyond it
    lower: float  # one-sided bounds at the gate's confidence, from the same test as the p-values
    upper: float
    method: str  # betting
    holds: bool = False  # after the correction across variants
    broken: bool = False
    extra: dict = field(default_factory=dict)  # reported beside the bounds: the KL's cap and the rows above it


@dataclass
class Evidence:
    """Everything one variant is judged on."""

    name: str
    contexts: Contexts
    checks: list[Check]
    p_pass: float  # the variant's p-value for a PASS: its checks' largest (1 below gate.min_samples)
    floor: int  # gate.min_samples, resolved


def kl_cap(t) -> float | None:
    return None if t.max_mean_kl is None else KL_CAP_FACTOR * t.max_mean_kl


def evaluate(name: str, ctx: Contexts, t, floor: int) -> Evidence:
    """The checks of one variant at the gate's thresholds, by betting."""
    checks = []
    if t.max_drop is not None:
        checks.append(_bet("drop", ctx.drop, t.max_drop, -1.0, 1.0, t))
    if t.max_flip_rate is not None:
        checks.append(_bet("flips", ctx.lost, t.max_flip_rate, 0.0, 1.0, t))
    checks += _kl_checks(ctx, t)
    p_pass = max([c.p_holds for c in checks], default=0.0)
    if ctx.n < floor or ctx.n == 0:
        p_pass = 1.0
    return Evidence(name, ctx, checks, p_pass, floor)


def _kl_checks(ctx: Contexts, t) -> list[Check]:
    """The KL, where the rows carry it: its mean with each row capped (kl), and the share of rows above the cap
    (kl_tail), which the capped mean cannot see: 1% of rows at 10 nats has a true mean at max_mean_kl=0.1 and a
    capped one of 0.03. A FAIL on the mean bounds the mean KL itself from below, uncapped: a lower bound of the mean
    of values >= 0 needs no upper end, so a row above the cap is evidence of a FAIL, not thrown away."""
    cap = kl_cap(t)
    if cap is None or ctx.kl is None:
        return []
    rows = int(round(float(np.sum(ctx.kl_above * ctx.questions))))
    extra = {"cap": cap, "rows_above_cap": rows, "share_above_cap": rows / max(int(np.sum(ctx.questions)), 1)}
    kl = _bet("kl", ctx.kl, t.max_mean_kl / cap, 0.0, 1.0, t, fail=(ctx.kl_raw, t.max_mean_kl, 0.0, math.inf))
    kl.limit, kl.upper = t.max_mean_kl, kl.upper * cap
    kl.extra = {**extra, "bounds_of": ["mean KL", f"mean of min(KL, {cap:g} nats)"]}
    if t.max_kl_tail_share is None:
        return [kl]
    share = t.max_kl_tail_share
    tail = _bet("kl_tail", ctx.kl_above, share, 0.0, 1.0, t, fail=(ctx.kl_above, share, 0.0, 1.0))
    tail.extra = extra
    return [kl, tail]


def kl_words(c: Check) -> str:
    """How the capped mean KL was counted, for the gate's messages: the cap and the rows above it."""
    above, share = c.extra["rows_above_cap"], c.extra["share_above_cap"]
    counted = f"{above} rows above it ({share:.1%}), judged by max_kl_tail_share" if above else "none above it"
    return f"each row counted up to {c.extra['cap']:g} nats; {counted}"


def _bet(what: str, x: np.ndarray, limit: float, lo: float, hi: float, t, fail: tuple | None = None) -> Check:
    """A check by betting: p-values 1 / wealth, bounds at the gate's error rate. `fail`: (values, limit, lo, hi) of
    the FAIL side (p_broken, lower), bet on with betting.TAIL_BETS, where it is not the PASS side's (the KL's)."""
    alpha = 1 - t.confidence
    if x.size == 0:
        return Check(what, limit, 1.0, 1.0, lo, hi, "betting")
    p_holds = betting.p_value(x, limit, lo, hi, below=True)
    upper = betting.bound(x, alpha, lo, hi, upper=True)
    fx, flimit, flo, fhi, bets = (x, limit, lo, hi, betting.BETS) if fail is None else (*fail, betting.TAIL_BETS)
    p_broken = betting.p_value(fx, flimit, flo, fhi, below=False, bets=bets)
    lower = betting.bound(fx, alpha, flo, fhi, upper=False, bets=bets)
    return Check(what, limit, p_holds, p_broken, lower, upper, "betting")
