"""Sample sizes by power: how many samples (contexts) give a PASS with 80% or 90% chance when a policy loses and
gains at given rates, for `python -m evalkit.gate --plan`, and the contexts an INCONCLUSIVE verdict asks for.

- A run judged once, one 0/1 question per context: the chance of a PASS is a finite sum over the outcomes (b lost,
  c gained) of the multinomial, each judged by the exact first look (evalkit.exact): exact enumeration.
- Judged by betting (a later look, or several questions per context): with one question per context the same
  enumeration; with several, questions of a context share a random effect (a Dirichlet-multinomial with
  intra-context correlation `icc`: icc 0, independent questions; 1, a context's questions share one fate), and
  the chance is counted over seeded draws (Monte Carlo).
- The advice after an INCONCLUSIVE look: contexts drawn like the ones seen, about 80% chance at the next look
  (evalkit.betting.contexts_to_show, a normal approximation to the wealth's growth).
"""

from __future__ import annotations

import math

import numpy as np

from evalkit.gate import betting, exact
from evalkit.gate.checks import first_spent, kl_cap

POWER = 0.8  # the chance of a PASS the advice sizes for
LIMIT = 20_000  # samples beyond which the planner says "no PASS in reach"


def _level(t, variants: int) -> float:
    alpha = 1 - t.confidence
    return alpha / variants if t.multiplicity != "none" and variants > 1 else alpha


def _reachable(t, p_lost: float, p_gained: float) -> bool:
    if t.max_drop is not None and p_lost - p_gained >= t.max_drop:
        return False
    return t.max_flip_rate is None or p_lost < t.max_flip_rate


def first_look_samples(t, floor: int, p_lost: float, p_gained: float, target: float, variants: int = 1) -> int | None:
    """The fewest samples whose first look PASSes with chance >= target (exact enumeration), None out of reach."""
    if not _reachable(t, p_lost, p_gained):
        return None
    level = _level(t, variants)

    def chance(n: int, checked: bool) -> float:
        design = exact.Design(n, t.max_drop, t.max_flip_rate, floor)
        return exact.power(design, level, p_lost, p_gained, checked)

    return _smallest(chance, max(floor, 1), target)


SAWTOOTH = 0.15  # more than the chance of a discrete test ever falls as n grows (about 0.11 at 2% loss)


def _smallest(chance, start: int, target: float) -> int | None:
    """The smallest n >= start with chance(n, checked=True) >= target. The chance of a discrete test rises with n in
    a saw-tooth (at 2% loss, 0.809 at n = 234, 0.737 at 259, 0.847 at 260), so a bisection could step over the
    first such n: grow by a tenth while the quick chance is more than SAWTOOTH below the target, then scan every n."""
    near = start
    while chance(near, False) < target - SAWTOOTH:
        if near >= LIMIT:
            return None
        near = min(LIMIT, near + max(1, near // 10))
    for n in range(max(start, near - max(1, near // 10)), LIMIT + 1):
        if chance(n, False) >= target and chance(n, True) >= target:
            return n
    return None


def betting_power_counts(t, n: int, budget: float, p_lost: float, p_gained: float) -> float:
    """The chance that the betting test PASSes n one-question contexts: exact enumeration over (b lost, c gained),
    the region b <= edge(c) (the wealth falls with every loss)."""
    need = math.log(1 / budget)

    def p_of(b, c):  # 0 where the test PASSes, 1 where it does not (exact._edge finds the edge at 0.5)
        ok = np.ones(np.shape(b), dtype=bool)
        if t.max_drop is not None:
            counts = np.stack([b, c, n - b - c], axis=-1)
            ok &= betting.log_wealth_counts(counts, [1.0, -1.0, 0.0], t.max_drop, -1.0, 1.0) >= need
        if t.max_flip_rate is not None:
            ok &= (
                betting.log_wealth_counts(np.stack([b, n - b], axis=-1), [1.0, 0.0], t.max_flip_rate, 0.0, 1.0) >= need
            )
        return np.where(ok, 0.0, 1.0)

    edge = exact.edge(n, p_of, 0.5, down=True)
    return float(exact.chance(n, edge, p_lost, p_gained, down=True)[0])


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

        def chance(n: int, _checked: bool) -> float:
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


def contexts_needed(e, t, spent, first: bool, variants: int = 1) -> int | None:
    """The contexts the next look needs to PASS with about 80% chance if new contexts come like the ones seen (None
    when they do not favour a PASS): the next look is judged by betting, with what this look leaves."""
    if first and e.exact:
        spent = first_spent(e.contexts.n, t, e.floor, fail=False)
    level = _level(t, variants)
    ctx, need = e.contexts, 0.0
    for c in e.checks:
        values = {"drop": ctx.drop, "flips": ctx.lost, "kl": ctx.kl}[c.what]
        lo = -1.0 if c.what == "drop" else 0.0
        target = c.limit if c.what != "kl" else c.limit / kl_cap(t)
        budget = level - spent.holds.get(c.what, 0.0)
        need = max(need, betting.contexts_to_show(values, target, lo, 1.0, budget, POWER))
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
    if m == 1:
        lines += ["", "Judged once (the run's first look; exact enumeration): samples for a PASS with 80% / 90% power:"]
        for p_lost, p_gained in rates:
            found = tuple(first_look_samples(t, floor, p_lost, p_gained, q, variants) for q in (0.8, 0.9))
            lines.append(f"  loss rate {p_lost:>5.1%}, gain rate {p_gained:>5.1%}: {_pair(found, 1, 1, cells)}")
        lines += [
            "",
            f"Judged again after a first look of fewer than {floor} samples (such a look spends nothing on a PASS; "
            "every later look is the anytime-valid betting test, exact enumeration):",
        ]
    else:
        lines += [
            "",
            f"{m} questions per context, intra-context correlation {icc} (every look: the anytime-valid betting test "
            "on contexts; Monte Carlo, 2,000 seeded draws):",
        ]
    for p_lost, p_gained in rates:
        found = tuple(betting_contexts(t, floor, p_lost, p_gained, q, m, icc, variants=variants) for q in (0.8, 0.9))
        lines.append(f"  loss rate {p_lost:>5.1%}, gain rate {p_gained:>5.1%}: {_pair(found, 1, m, cells)}")
    lines.append(
        "A first look at or above that count uses nearly all of the error rate: size the run here and judge it once."
        if m == 1
        else "Contexts are the unit: questions that share a compression share its fate."
    )
    if t.min_cell_accuracy is not None:
        family = variants * cells
        level = (1 - t.confidence) / family if t.multiplicity != "none" else 1 - t.confidence
        first = cell_samples(t.min_cell_accuracy, level)
        later = betting_cell_samples(t.min_cell_accuracy, level)
        lines += [
            "",
            f"per cell: {first} samples at the first look ({later} contexts when judged by betting) before a cell "
            f"whose answers are all wrong is shown below min_cell_accuracy={t.min_cell_accuracy} ({family} cells in "
            "the family); smaller cells are not judged",
        ]
    lines.append(f"\ndefault gate.min_samples (a PASS with no loss at all, first look): {floor}")
    return lines


def cell_samples(limit: float, alpha: float) -> int:
    """Samples a cell needs before a policy that gets all of them wrong is shown below `limit` at `alpha` (exact)."""
    if limit <= 0:
        return 10**9
    if limit >= 1:
        return 1
    return max(1, math.ceil(math.log(alpha) / math.log(limit) - 1e-12))


def betting_cell_samples(limit: float, budget: float) -> int:
    """The same for the betting test: contexts until the wealth on an all-wrong cell reaches 1 / budget."""
    if limit <= 0 or budget <= 0:
        return 10**9
    n = np.arange(1, LIMIT + 1)
    wealth = betting.log_wealth_counts(np.stack([n, 0 * n], axis=-1), [0.0, 1.0], limit, 0.0, 1.0)
    hit = np.nonzero(wealth >= math.log(1 / budget))[0]
    return int(hit[0]) + 1 if hit.size else 10**9
