"""The evidence on one variant: for each criterion (the accuracy drop, the flip rate, the KL) a p-value for "holds"
(a PASS needs every one: an intersection-union test) and one for "broken" (a FAIL), with the bounds they agree with.

Two ways to judge, chosen by what the records are (docs/gate-statistics.md):

- **exact first look**: 0/1 scores, one question per context, and the first judgement of the run (its sample count
  was fixed before any data): Tango's score test with the exact floor for the drop, the exact binomial test for the
  flip rate, their joint error rate checked exactly (evalkit.exact). One question per context gives the numbers of
  a per-sample gate.
- **betting**: every other case (graded scores, several questions per context, a later look, the KL): the
  anytime-valid test of evalkit.betting on the per-context means, at what the run's first look left (`Spent`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.stats import binom

from evalkit.gate import betting, exact
from evalkit.gate.contexts import KL_CAP_FACTOR, Contexts
from evalkit.gate.stats import binary_bounds, binary_p, clopper_pearson_upper


@dataclass
class Spent:
    """Error rate that the run's first (exact) look could have used, per check, which later looks no longer have."""

    holds: dict[str, float] = field(default_factory=dict)  # check -> the chance of a wrong PASS it used
    broken: dict[str, float] = field(default_factory=dict)  # check -> the chance of a wrong FAIL


@dataclass
class Check:
    """One criterion of one variant."""

    what: str  # drop, flips, kl
    limit: float
    p_holds: float  # small: shown within the limit
    p_broken: float  # small: shown beyond it
    lower: float  # one-sided bounds at the gate's confidence, from the same test as the p-values
    upper: float
    method: str  # tango-score, exact-binomial, betting
    budget: float  # the error rate the test of "holds" had at its disposal (the gate's alpha, less what was spent)
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
    exact: bool  # judged by the exact first look
    floor: int  # gate.min_samples, resolved
    corrected: bool = False  # the exact size, not Tango's approximation, decided the PASS p-value


def kl_cap(t) -> float | None:
    return None if t.max_mean_kl is None else KL_CAP_FACTOR * t.max_mean_kl


def evaluate(name: str, ctx: Contexts, t, floor: int, first: bool, spent: Spent) -> Evidence:
    """The checks of one variant at the gate's thresholds; `first`: this is the run's first look."""
    if first and ctx.single and ctx.binary and ctx.n > 0:
        return _exact(name, ctx, t, floor)
    return _betting(name, ctx, t, floor, spent)


def _exact(name: str, ctx: Contexts, t, floor: int) -> Evidence:
    alpha = 1 - t.confidence
    n = ctx.n
    b, c = ctx.counts()
    checks = []
    design = exact.Design(n, t.max_drop, t.max_flip_rate, floor)
    if t.max_drop is not None:
        below, above = binary_p(b, c, n, t.max_drop)
        above = exact.corrected(above, lambda x: exact.drop_fail_size(design, x))
        lo, hi = binary_bounds(b, c, n, t.confidence)
        checks.append(Check("drop", t.max_drop, below, above, lo, hi, "tango-score", alpha))
    if t.max_flip_rate is not None:
        f = t.max_flip_rate
        lo = 1 - clopper_pearson_upper(n - b, n, alpha)
        hi = clopper_pearson_upper(b, n, alpha)
        checks.append(
            Check("flips", f, float(binom.cdf(b, n, f)), float(binom.sf(b - 1, n, f)), lo, hi, "exact-binomial", alpha)
        )
    joint = float(design.pass_p(b, c))
    p_pass = exact.corrected(joint, lambda x: exact.pass_size(design, x, "drop")) if t.max_drop is not None else joint
    kl = _kl_check(ctx, t, Spent())
    if kl is not None:
        checks.append(kl)
        p_pass = max(p_pass, kl.p_holds)
    corrected = p_pass > max([joint] + [k.p_holds for k in checks])
    return Evidence(name, ctx, checks, p_pass, True, floor, corrected)


def _betting(name: str, ctx: Contexts, t, floor: int, spent: Spent) -> Evidence:
    checks = []
    if t.max_drop is not None:
        checks.append(_bet("drop", ctx.drop, t.max_drop, -1.0, 1.0, t, spent))
    if t.max_flip_rate is not None:
        checks.append(_bet("flips", ctx.lost, t.max_flip_rate, 0.0, 1.0, t, spent))
    kl = _kl_check(ctx, t, spent)
    if kl is not None:
        checks.append(kl)
    p_pass = max([c.p_holds for c in checks], default=0.0)
    if ctx.n < floor or ctx.n == 0:
        p_pass = 1.0
    return Evidence(name, ctx, checks, p_pass, False, floor)


def _kl_check(ctx: Contexts, t, spent: Spent) -> Check | None:
    cap = kl_cap(t)
    if cap is None or ctx.kl is None:
        return None
    check = _bet("kl", ctx.kl, t.max_mean_kl / cap, 0.0, 1.0, t, spent)
    check.limit, check.lower, check.upper = t.max_mean_kl, check.lower * cap, check.upper * cap
    rows = int(round(float(np.sum(ctx.kl_above * ctx.questions)))) if ctx.kl_above is not None else 0
    check.extra = {"cap": cap, "rows_above_cap": rows, "share_above_cap": rows / max(int(np.sum(ctx.questions)), 1)}
    return check


def kl_words(c: Check) -> str:
    """How the KL was counted, for the gate's messages: the cap and the rows above it."""
    above, share = c.extra["rows_above_cap"], c.extra["share_above_cap"]
    counted = f"{above} rows above it ({share:.1%}), each counted at the cap" if above else "none above it"
    return f"each row capped at {c.extra['cap']:g} nats; {counted}"


def _bet(what: str, x: np.ndarray, limit: float, lo: float, hi: float, t, spent: Spent) -> Check:
    """A check by betting: p-values spent + 1 / wealth, bounds at the budget left."""
    alpha = 1 - t.confidence
    s_holds, s_broken = spent.holds.get(what, 0.0), spent.broken.get(what, 0.0)
    if x.size == 0:
        return Check(what, limit, 1.0, 1.0, lo, hi, "betting", alpha - s_holds)
    p_holds = betting.p_value(x, limit, lo, hi, below=True, spent=s_holds)
    p_broken = betting.p_value(x, limit, lo, hi, below=False, spent=s_broken)
    upper = betting.bound(x, alpha - s_holds, lo, hi, upper=True)
    lower = betting.bound(x, alpha - s_broken, lo, hi, upper=False)
    return Check(what, limit, p_holds, p_broken, lower, upper, "betting", alpha - s_holds)


def first_spent(n: int, t, floor: int, fail: bool = True) -> Spent:
    """What an exact first look at n one-question contexts could have spent, at these thresholds (fail=False: on a
    PASS only, all the advice needs)."""
    alpha = 1 - t.confidence
    design = exact.Design(n, t.max_drop, t.max_flip_rate, floor)
    return Spent(exact.pass_spent(design, alpha), exact.fail_spent(design, alpha) if fail else {})


def add(a: Spent, b: Spent) -> Spent:
    """Two first looks (runs merged after each was judged alone): both spent."""
    keys = lambda x, y: set(x) | set(y)  # noqa: E731
    return Spent(
        {k: a.holds.get(k, 0.0) + b.holds.get(k, 0.0) for k in keys(a.holds, b.holds)},
        {k: a.broken.get(k, 0.0) + b.broken.get(k, 0.0) for k in keys(a.broken, b.broken)},
    )
