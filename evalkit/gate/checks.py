"""The evidence on one variant: for each criterion (the accuracy drop, the flip rate, the KL) a p-value for "holds"
(a PASS needs every one: an intersection-union test) and one for "broken" (a FAIL), with the bounds they agree with.

Every judgement, the first included, is the anytime-valid betting test of evalkit.stats.betting on the per-context means
(docs/gate-statistics.md): its bets are constant, so the wealth over nested prefixes of the same contexts is one
supermartingale, and judging again (after more samples, in a fresh folder, from a report or a CI job) adds no error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from evalkit.gate.contexts import KL_CAP_FACTOR, Contexts
from evalkit.stats import betting


@dataclass
class Check:
    """One criterion of one variant."""

    what: str  # drop, flips, kl
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
    kl = _kl_check(ctx, t)
    if kl is not None:
        checks.append(kl)
    p_pass = max([c.p_holds for c in checks], default=0.0)
    if ctx.n < floor or ctx.n == 0:
        p_pass = 1.0
    return Evidence(name, ctx, checks, p_pass, floor)


def _kl_check(ctx: Contexts, t) -> Check | None:
    cap = kl_cap(t)
    if cap is None or ctx.kl is None:
        return None
    check = _bet("kl", ctx.kl, t.max_mean_kl / cap, 0.0, 1.0, t)
    check.limit, check.lower, check.upper = t.max_mean_kl, check.lower * cap, check.upper * cap
    rows = int(round(float(np.sum(ctx.kl_above * ctx.questions)))) if ctx.kl_above is not None else 0
    check.extra = {"cap": cap, "rows_above_cap": rows, "share_above_cap": rows / max(int(np.sum(ctx.questions)), 1)}
    if rows:  # no number of rows bounds a mean beyond the cap: a row there fails its context, and the check can't hold
        check.p_holds = 1.0
    return check


def kl_words(c: Check) -> str:
    """How the KL was counted, for the gate's messages: the cap and the rows above it."""
    above, share = c.extra["rows_above_cap"], c.extra["share_above_cap"]
    counted = (
        f"{above} rows above it ({share:.1%}): a mean beyond the cap is bounded by no number of rows, so a row above "
        "it fails its context and the KL cannot be shown to hold"
        if above
        else "none above it"
    )
    return f"each row capped at {c.extra['cap']:g} nats; {counted}"


def _bet(what: str, x: np.ndarray, limit: float, lo: float, hi: float, t) -> Check:
    """A check by betting: p-values 1 / wealth, bounds at the gate's error rate."""
    alpha = 1 - t.confidence
    if x.size == 0:
        return Check(what, limit, 1.0, 1.0, lo, hi, "betting")
    p_holds = betting.p_value(x, limit, lo, hi, below=True)
    p_broken = betting.p_value(x, limit, lo, hi, below=False)
    upper = betting.bound(x, alpha, lo, hi, upper=True)
    lower = betting.bound(x, alpha, lo, hi, upper=False)
    return Check(what, limit, p_holds, p_broken, lower, upper, "betting")
