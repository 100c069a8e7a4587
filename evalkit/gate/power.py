"""Sample sizes by power: how many samples (contexts) give a PASS with 80% or 90% chance when a policy loses and
gains at given rates, for `python -m evalkit.gate --plan`, and the contexts an INCONCLUSIVE verdict asks for. Every
look is the anytime-valid betting test (evalkit.gate.checks):

- One 0/1 question per context: the chance of a PASS is a finite sum over the outcomes (b lost, c gained) of the
  multinomial: exact enumeration.
- Several questions per context: they share a random effect (a Dirichlet-multinomial with intra-context correlation
  `icc`: icc 0, independent questions; 1, a context's questions share one fate), and the chance is counted over
  seeded draws (Monte Carlo).
- The advice after an INCONCLUSIVE look: contexts drawn like the ones seen, about 80% chance at the next look
  (evalkit.stats.betting.contexts_to_show, a normal approximation to the wealth's growth).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy.stats import binom

from evalkit.gate.checks import kl_cap
from evalkit.stats import betting

POWER = 0.8  # the chance of a PASS the advice sizes for
LIMIT = 20_000  # samples beyond which the planner says "no PASS in reach"


def _level(t, variants: int) -> float:
    alpha = 1 - t.confidence
    return alpha / variants if t.multiplicity != "none" and variants > 1 else alpha


def _reachable(t, p_lost: float, p_gained: float) -> bool:
    if t.max_drop is not None and p_lost - p_gained >= t.max_drop:
        return False
    return t.max_flip_rate is None or p_lost < t.max_flip_rate


def lossless_contexts(t, budget: float) -> int:
    """The fewest one-question contexts with nothing lost that PASS by betting at `budget`: the drop's and the flip
    rate's wealth on all-zero values both reach 1 / budget (LIMIT when they never do)."""
    return _lossless(t.max_drop, t.max_flip_rate, budget)


@functools.lru_cache(maxsize=256)
def _lossless(max_drop: float | None, max_flip_rate: float | None, budget: float) -> int:
    """lossless_contexts of the limits themselves (each variant's floor asks it again: computed once)."""
    n = np.arange(1, LIMIT + 1)
    zeros = np.stack([n, 0 * n], axis=-1)  # counts of the values 0 (nothing lost) and 1
    ok = np.ones(n.shape, dtype=bool)
    if max_drop is not None:
        ok &= betting.log_wealth_counts(zeros, [0.0, 1.0], max_drop, -1.0, 1.0) >= math.log(1 / budget)
    if max_flip_rate is not None:
        ok &= betting.log_wealth_counts(zeros, [0.0, 1.0], max_flip_rate, 0.0, 1.0) >= math.log(1 / budget)
    hit = np.nonzero(ok)[0]
    return int(hit[0]) + 1 if hit.size else LIMIT


def judged_once_lossless(t) -> int | None:
    """The fewest contexts with nothing lost that a test judged once, at a count fixed before any data, would PASS:
    (1 - max_drop)^n <= alpha (the exact binomial tail at 0 lost), for the planner's statement of what judging at
    every look costs. None without a margin."""
    if t.max_drop is None:
        return None
    # log1p: for a margin below 1e-16, log(1 - max_drop) is log(1.0) = 0 and the division fails
    return math.ceil(math.log(1 - t.confidence) / math.log1p(-t.max_drop) - 1e-12)


SAWTOOTH = 0.15  # more than the chance of a discrete test ever falls as n grows


def _smallest(chance, start: int, target: float) -> int | None:
    """The smallest n >= start with chance(n) >= target. The chance of a discrete test rises with n in a saw-tooth,
    so a bisection could step over the first such n: grow by a tenth while the chance is more than SAWTOOTH below
    the target, then scan every n."""
    if start > LIMIT:  # beyond the planner's reach; chance(start) would enumerate start + 1 outcomes (GBs)
        return None
    near = start
    while chance(near) < target - SAWTOOTH:
        if near >= LIMIT:
            return None
        near = min(LIMIT, near + max(1, near // 10))
    for n in range(max(start, near - max(1, near // 10)), LIMIT + 1):
        if chance(n) >= target:
            return n
    return None


def betting_power_counts(t, n: int, budget: float, p_lost: float, p_gained: float) -> float:
    """The chance that the betting test PASSes n one-question contexts: exact enumeration over (b lost, c gained),
    the region b <= edge(c) (the wealth falls with every loss)."""
    need = math.log(1 / budget)

    def p_of(b, c):  # 0 where the test PASSes, 1 where it does not
        ok = np.ones(np.shape(b), dtype=bool)
        if t.max_drop is not None:
            counts = np.stack([b, c, n - b - c], axis=-1)
            ok &= betting.log_wealth_counts(counts, [1.0, -1.0, 0.0], t.max_drop, -1.0, 1.0) >= need
        if t.max_flip_rate is not None:
            ok &= (
                betting.log_wealth_counts(np.stack([b, n - b], axis=-1), [1.0, 0.0], t.max_flip_rate, 0.0, 1.0) >= need
            )
        return np.where(ok, 0.0, 1.0)

    return float(chance(n, edge(n, p_of), p_lost, p_gained)[0])


def edge(n: int, p_of) -> np.ndarray:
    """Per gain count c = 0..n: the largest b whose outcome (b lost, c gained) PASSes (p_of(b, c) is 0 there, 1 where
    it does not), -1 when none. A bisection over b for every c at once (a loss never makes a PASS easier)."""
    c = np.arange(n + 1)
    lo, hi = np.full(n + 1, -1), n - c
    while np.any(lo < hi):
        mid = (lo + hi + 1) // 2
        ok = p_of(np.clip(mid, 0, n - c), c) <= 0.5
        lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid - 1)
    return lo


def chance(n: int, edge_: np.ndarray, p_lost: float, p_gained: float) -> np.ndarray:
    """P(B <= edge[C]) for multinomial (B lost, C gained) of n at these rates: C ~ Bin(n, p_gained), and B given
    C = c ~ Bin(n - c, p_lost / (1 - p_gained))."""
    c = np.arange(n + 1)
    g = np.atleast_1d(np.asarray(p_gained, dtype=float))[:, None]
    q = np.clip(np.atleast_1d(np.asarray(p_lost, dtype=float))[:, None] / np.maximum(1 - g, 1e-300), 0.0, 1.0)
    return np.sum(binom.pmf(c, n, g) * binom.cdf(edge_, n - c, q), axis=-1)


def draw_contexts(rng, draws: int, k: int, m: int, p_lost: float, p_gained: float, icc: float):
    """(lost, gained) question counts per context, shaped (draws, k): m questions a context, their loss and gain
    chances drawn per context from a Dirichlet with intra-context correlation icc (a Dirichlet-multinomial: icc 0,
    independent questions; 1, every question of a context shares one fate)."""
    mean = np.array([p_lost, p_gained, max(1.0 - p_lost - p_gained, 0.0)])
    some = mean > 0
    if icc <= 0 or m == 1:
        probs = np.broadcast_to(mean, (draws, k, 3))
    elif icc >= 1:
        probs = np.eye(3)[rng.choice(3, size=(draws, k), p=mean / mean.sum())]
    else:
        probs = np.zeros((draws, k, 3))
        probs[..., some] = rng.dirichlet(mean[some] * (1 / icc - 1), size=(draws, k))
    counts = rng.multinomial(m, probs)
    return counts[..., 0], counts[..., 1]


def betting_passes(t, lost, gained, m: int, budget: float) -> np.ndarray:
    """For draws of contexts (lost, gained counts, shaped (draws, k)): does the betting test PASS after each prefix?
    (draws, k) booleans: the contexts taken in turn, as one run extended."""
    need = math.log(1 / budget)
    ok = np.ones(lost.shape, dtype=bool)
    if t.max_drop is not None:
        ok &= betting.log_wealth_path((lost - gained) / m, t.max_drop, -1.0, 1.0) >= need
    if t.max_flip_rate is not None:
        ok &= betting.log_wealth_path(lost / m, t.max_flip_rate, 0.0, 1.0) >= need
    return ok


def betting_contexts(
    t,
    floor: int,
    p_lost: float,
    p_gained: float,
    target: float,
    m: int = 1,
    icc: float = 0.0,
    budget: float | None = None,
    variants: int = 1,
    draws: int = 2000,
    seed: int = 0,
) -> int | None:
    """The fewest contexts the betting test PASSes with chance >= target: exact for one question per context,
    Monte Carlo (seeded draws) for several."""
    if not _reachable(t, p_lost, p_gained):
        return None
    budget = _level(t, variants) if budget is None else budget
    if m == 1:
        seen: dict[int, float] = {}

        def chance(n: int) -> float:
            if n not in seen:
                seen[n] = betting_power_counts(t, n, budget, p_lost, p_gained)
            return seen[n]

        return _smallest(chance, max(floor, 1), target)
    rng = np.random.default_rng(seed)
    k = 128
    while k <= LIMIT:
        lost, gained = draw_contexts(rng, draws, k, m, p_lost, p_gained, icc)
        share = betting_passes(t, lost, gained, m, budget).mean(axis=0)
        hit = np.nonzero((share >= target) & (np.arange(1, k + 1) >= floor))[0]
        if hit.size:
            return int(hit[0]) + 1
        k *= 2
    return None


def contexts_needed(e, t, variants: int = 1, level: float | None = None) -> int | None:
    """The contexts the next look needs to PASS with about 80% chance if new contexts come like the ones seen (None
    when they do not favour a PASS), tested at `level` (default: the gate's error rate over `variants`)."""
    level = _level(t, variants) if level is None else level
    ctx, need = e.contexts, 0.0
    for c in e.checks:
        values = {"drop": ctx.drop, "flips": ctx.lost, "kl": ctx.kl, "kl_tail": ctx.kl_above}[c.what]
        lo = -1.0 if c.what == "drop" else 0.0
        target = c.limit if c.what != "kl" else c.limit / kl_cap(t)
        need = max(need, betting.contexts_to_show(values, target, lo, 1.0, level, POWER))
    if not math.isfinite(need):
        return None
    return max(math.ceil(need), e.floor, ctx.n + 1)


PLAN_RATES = ((0.0, 0.0), (0.005, 0.0), (0.01, 0.0), (0.02, 0.0), (0.02, 0.02))


def _pair(found: tuple[int | None, int | None], per: int, m: int, cells: int) -> str:
    if found[0] is None:
        return "no PASS in reach (the rates themselves break a limit, or it needs over 20,000)"
    unit = "samples" if m == 1 else "contexts"
    text = " / ".join("-" if n is None else str(n) for n in found) + f" {unit}"
    if m > 1:
        text += " (" + " / ".join("-" if n is None else str(n * m) for n in found) + " questions)"
    if cells > 1:
        text += " (" + " / ".join("-" if n is None else str(math.ceil(n / cells)) for n in found) + " per cell)"
    return text


def samples_advice(
    t, floor: int, variants: int = 1, cells: int = 1, rates=None, m: int = 1, icc: float = 0.5
) -> list[str]:
    """What a PASS needs at these thresholds: samples (contexts) for 80% and 90% power at each loss/gain rate."""
    rates = rates or PLAN_RATES
    lines = [
        f"gate: margin max_drop={t.max_drop}, max_flip_rate={t.max_flip_rate}, one-sided confidence "
        f"{t.confidence:.0%}, multiplicity {t.multiplicity} over {variants} variant(s) and {cells} cell(s) each",
    ]
    unit = "samples" if m == 1 else f"contexts ({m} questions each, intra-context correlation {icc}; Monte Carlo)"
    lines += ["", f"Every look is the anytime-valid betting test: {unit} for a PASS with 80% / 90% power:"]
    for p_lost, p_gained in rates:
        found = tuple(betting_contexts(t, floor, p_lost, p_gained, q, m, icc, variants=variants) for q in (0.8, 0.9))
        lines.append(f"  loss rate {p_lost:>5.1%}, gain rate {p_gained:>5.1%}: {_pair(found, 1, m, cells)}")
    lines += _cost(t, variants)
    if m > 1:
        lines.append("Contexts are the unit: questions that share a compression share its fate.")
    if t.min_cell_accuracy is not None:
        family = variants * cells
        level = (1 - t.confidence) / family if t.multiplicity != "none" else 1 - t.confidence
        need = betting_cell_samples(t.min_cell_accuracy, level)
        lines += [
            "",
            f"per cell: {need} contexts before a cell whose answers are all wrong is shown below min_cell_accuracy="
            f"{t.min_cell_accuracy} at any look ({family} cells in the family); smaller cells are not judged",
        ]
    lines += _kl_lines(t, variants)
    lines.append(f"\ngate.min_samples: {floor} (null: the contexts a PASS with no loss at all needs)")
    return lines


def _kl_lines(t, variants: int) -> list[str]:
    """What runs with KL rows need: the documents of a KL PASS, and of a FAIL at twice max_mean_kl."""
    if t.max_mean_kl is None or t.max_mean_kl <= 0:
        return []
    fail = kl_fail_contexts(t, variants, POWER)
    tail = "" if t.max_kl_tail_share is None else f" and max_kl_tail_share={t.max_kl_tail_share}"
    return [
        "",
        f"runs with KL rows (max_mean_kl={t.max_mean_kl}, each row counted up to {kl_cap(t):g} nats{tail}): a PASS "
        f"needs {kl_pass_contexts(t, _level(t, variants))} documents with no row above the cap; a mean KL at twice "
        f"the limit is shown (FAIL) with {POWER:.0%} chance by {fail or 'over 20,000'} documents with its rows spread "
        "as far as the cap allows (the slowest case below it)",
    ]


def kl_pass_contexts(t, budget: float) -> int:
    """The fewest documents whose KL rows are all 0 that PASS the KL checks by betting at `budget`: the capped mean's
    count (112 at the defaults) or the tail share's (378), the larger."""
    n = np.arange(1, LIMIT + 1)
    zeros = np.stack([n, 0 * n], axis=-1)  # counts of the values 0 and 1
    need = -math.log(max(budget, 1e-300))  # a budget shared by more variants than a float holds: never reached
    ok = betting.log_wealth_counts(zeros, [0.0, 1.0], t.max_mean_kl / kl_cap(t), 0.0, 1.0) >= need
    if t.max_kl_tail_share is not None:
        ok &= betting.log_wealth_counts(zeros, [0.0, 1.0], t.max_kl_tail_share, 0.0, 1.0) >= need
    hit = np.nonzero(ok)[0]
    return int(hit[0]) + 1 if hit.size else LIMIT


def kl_fail_contexts(t, variants: int = 1, power: float = POWER) -> int | None:
    """The fewest documents at which a mean KL of twice max_mean_kl is shown broken (FAIL) with chance `power`, its
    rows as spread as the cap allows: a share 2 max_mean_kl / cap of them at the cap, the rest at 0 (a spread that
    only lowers each bet's growth, by Jensen). Exact: the FAIL needs k*(n) rows at the cap, binomial. Its error rate
    is Holm's first step over every claim of a broken check (the variants' checks)."""
    cap, checks = kl_cap(t), 2 + (t.max_drop is not None) + (t.max_flip_rate is not None)
    claims = variants * (checks - (t.max_kl_tail_share is None))
    budget = (1 - t.confidence) / (claims if t.multiplicity != "none" else 1)
    share, need = 2 * t.max_mean_kl / cap, -math.log(max(budget, 1e-300))

    def chance(n: int) -> float:
        k = np.arange(n + 1)
        counts = np.stack([n - k, k], axis=-1)  # rows at 0, rows at the cap
        wealth = betting.log_wealth_counts(counts, [0.0, cap], t.max_mean_kl, 0.0, math.inf, False, betting.TAIL_BETS)
        hit = np.nonzero(wealth >= need)[0]
        return float(binom.sf(hit[0] - 1, n, share)) if hit.size else 0.0

    return _smallest(chance, 1, power)


def _cost(t, variants: int) -> list[str]:
    """What judging at every look costs: a lossless PASS by betting against a test judged once at a fixed count."""
    once = judged_once_lossless(t)
    if once is None or variants > 1:
        return []
    return [
        f"With nothing lost a PASS needs {lossless_contexts(t, 1 - t.confidence)} contexts, where a test judged once, "
        f"at a count fixed before any data, would need {once}: the price of a verdict that holds however often the "
        "run is judged (a report, a CI job, a folder extended or judged afresh add no error)."
    ]


def betting_cell_samples(limit: float, budget: float) -> int:
    """The same for the betting test: contexts until the wealth on an all-wrong cell reaches 1 / budget."""
    if limit <= 0 or budget <= 0:
        return 10**9
    n = np.arange(1, LIMIT + 1)
    wealth = betting.log_wealth_counts(np.stack([n, 0 * n], axis=-1), [0.0, 1.0], limit, 0.0, 1.0)
    hit = np.nonzero(wealth >= math.log(1 / budget))[0]
    return int(hit[0]) + 1 if hit.size else 10**9
