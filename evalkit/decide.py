"""The gate's statistical decisions: for each variant PASS, FAIL or INCONCLUSIVE, and for each cell whether it is
shown to fail, with the family-wise error held across variants and across cells (evalkit.stats).

A variant PASSes when every check is *shown* to hold at the gate's confidence: the accuracy drop below `max_drop`
(non-inferiority) and the flip rate below `max_flip_rate`. Several checks of one variant need no correction among
themselves (a PASS needs all of them: an intersection-union test); the same check over several variants, and the
cell checks over all cells, are corrected (Holm or Bonferroni, `gate.multiplicity`). A variant FAILs when a check
is shown broken (the drop's lower bound above the margin, the flip rate above its limit, a cell shown below
`min_cell_accuracy`), and is INCONCLUSIVE otherwise: then the gate says how many samples would settle it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy.stats import binomtest, ttest_1samp

from evalkit.analysis import cell_key
from evalkit.stats import adjust, binary_bounds, clopper_pearson_upper, is_binary, paired_drop

PLAN_LOSS_RATES = (0.0, 0.005, 0.01, 0.02, 0.03)


@dataclass
class Check:
    """One statistical check of one variant: p-values for "holds" and for "broken", and what it is about."""

    what: str  # drop, flips
    p_holds: float
    p_broken: float
    holds: bool = False  # shown to hold, after the correction
    broken: bool = False  # shown broken, after the correction


@dataclass
class Decision:
    status: str  # PASS, FAIL or INCONCLUSIVE
    fail: list[str] = field(default_factory=list)
    open: list[str] = field(default_factory=list)  # why it is not yet a PASS
    samples_needed: int | None = None  # at the observed rates, the samples a PASS needs (0/1 scores)


def _drop_check(rows: list[dict], margin: float, level: float) -> tuple[Check, Any]:
    base = [r["baseline_score"] for r in rows]
    pol = [r["score"] for r in rows]
    p = paired_drop(base, pol, level)
    return Check("drop", *p.p_values(margin)), p


def _flip_check(lost: int, n: int, limit: float) -> Check:
    """Exact binomial tests of the loss rate against `limit`."""
    return Check(
        "flips",
        binomtest(lost, n, limit, alternative="less").pvalue,
        binomtest(lost, n, limit, alternative="greater").pvalue,
    )


def fewest_samples(lost: int, gained: int, n: int, t, binary: bool) -> int | None:
    """The fewest samples at which the observed loss and gain rates, kept, would show every check holding at the
    gate's confidence (0/1 scores; None for graded scores, or when the observed rates themselves break a limit)."""
    if not binary or n == 0:
        return None
    level = t.confidence
    if t.max_drop is not None and (lost - gained) / n >= t.max_drop:
        return None
    if t.max_flip_rate is not None and lost / n >= t.max_flip_rate:
        return None

    def passes(m: int) -> bool:
        b, c = lost * m / n, gained * m / n  # expected counts at the observed rates
        if t.max_drop is not None and binary_bounds(b, c, m, level)[1] >= t.max_drop:
            return False
        return t.max_flip_rate is None or clopper_pearson_upper(b, m, 1 - level) < t.max_flip_rate

    hi = 1
    while not passes(hi):
        if hi >= 10_000_000:
            return None
        hi *= 2
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) else (mid + 1, hi)
    return max(hi, t.min_samples or 0)


def min_samples(t) -> int:
    """The fewest samples a variant that loses nothing needs to PASS: the default `min_samples`."""
    return fewest_samples(0, 0, 1, replace(t, min_samples=0), True) or 1


def variant_decisions(by_variant: dict[str, list[dict]], t) -> dict[str, Decision]:
    """PASS, FAIL or INCONCLUSIVE for every variant from its statistical checks, corrected across variants."""
    alpha = 1 - t.confidence
    names = sorted(by_variant)
    checks: dict[str, list[Check]] = {name: [] for name in names}
    paired = {}
    for name in names:
        rows = by_variant[name]
        if t.max_drop is not None:
            check, paired[name] = _drop_check(rows, t.max_drop, t.confidence)
            checks[name].append(check)
        else:
            paired[name] = paired_drop([r["baseline_score"] for r in rows], [r["score"] for r in rows], t.confidence)
        if t.max_flip_rate is not None:
            checks[name].append(_flip_check(paired[name].lost, paired[name].n, t.max_flip_rate))
    for what in ("drop", "flips"):
        family = [(name, c) for name in names for c in checks[name] if c.what == what]
        for (_, c), ok in zip(family, adjust([c.p_holds for _, c in family], alpha, t.multiplicity), strict=True):
            c.holds = ok
        for (_, c), bad in zip(family, adjust([c.p_broken for _, c in family], alpha, t.multiplicity), strict=True):
            c.broken = bad
    out = {}
    k = len(names)
    corrected = f" after {t.multiplicity.capitalize()}'s correction over {k} variants" if k > 1 else ""
    for name in names:
        p, d = paired[name], Decision("INCONCLUSIVE")
        conf = f"{t.confidence:.0%}"
        for c in checks[name]:
            if c.what == "drop" and c.broken:
                d.fail.append(
                    f"{name}: accuracy drop {p.drop:+.3f}, at least {p.lower:.3f} ({conf} lower bound{corrected}): "
                    f"shown over the {t.max_drop} margin"
                )
            elif c.what == "drop" and not c.holds:
                d.open.append(
                    f"{name}: {p.lost} lost and {p.gained} gained of {p.n}: the drop may be as large as "
                    f"{p.upper:.3f} ({conf} upper bound, {p.method}{corrected}), not shown below the {t.max_drop} "
                    "margin"
                )
            elif c.what == "flips" and c.broken:
                d.fail.append(
                    f"{name}: {p.lost} of {p.n} samples flipped from right to wrong ({p.lost / p.n:.0%}): shown over "
                    f"the {t.max_flip_rate:.0%} flip-rate limit at {conf}{corrected}"
                )
            elif c.what == "flips" and not c.holds:
                d.open.append(
                    f"{name}: {p.lost} of {p.n} samples flipped from right to wrong: the flip rate is not shown below "
                    f"{t.max_flip_rate:.0%} at {conf}{corrected}"
                )
        floor = t.min_samples or 0
        if p.n < floor:
            d.open.append(f"{name}: {p.n} samples, fewer than gate.min_samples={floor}")
        if p.method == "none":
            d.open.append(f"{name}: {p.n} samples of graded scores; the bootstrap needs at least 20")
        binary = is_binary([r["score"] for r in by_variant[name]], [r["baseline_score"] for r in by_variant[name]])
        d.samples_needed = fewest_samples(p.lost, p.gained, p.n, t, binary) if d.open else None
        d.status = "FAIL" if d.fail else "INCONCLUSIVE" if d.open else "PASS"
        out[name] = d
    return out


SHOWN_TO_FAIL = "shown to fail"  # the one cell status that is a failure ("no failure shown", "not judged: ..." are not)


@dataclass
class CellResult:
    variant: str
    cell: str
    n: int
    lost: int
    gained: int
    baseline: float
    policy: float
    bounds: tuple[float, float]  # one-sided bounds on the cell's drop at the gate's confidence
    status: str  # "shown to fail", "no failure shown", "not judged: ..."
    p: float = math.nan


def cell_decisions(by_variant: dict[str, list[dict]], t) -> list[CellResult]:
    """Per variant and cell: is the policy's accuracy shown below `min_cell_accuracy` where the baseline reaches it?
    An exact binomial test (0/1 scores) or a one-sided t-test (graded), Holm or Bonferroni across all cells judged;
    a cell too small to ever be shown failing at the corrected level is `not judged`."""
    results: list[CellResult] = []
    scores_of: dict[tuple[str, str], list[float]] = {}  # (variant, cell) -> the policy's scores there
    for name in sorted(by_variant):
        cells: dict[str, list[dict]] = {}
        for r in by_variant[name]:
            cells.setdefault(cell_key(r["cell"]), []).append(r)
        for cell, rows in sorted(cells.items()):
            base, pol = [r["baseline_score"] for r in rows], [r["score"] for r in rows]
            scores_of[name, cell] = pol
            p = paired_drop(base, pol, t.confidence)
            results.append(
                CellResult(
                    name,
                    cell,
                    p.n,
                    p.lost,
                    p.gained,
                    float(np.mean(base)),
                    float(np.mean(pol)),
                    (p.lower, p.upper),
                    "no failure shown",
                )
            )
    limit, weak = t.min_cell_accuracy, t.min_baseline_accuracy
    if limit is None:
        for c in results:
            c.status = "not judged: gate.min_cell_accuracy is null"
        return results
    alpha = 1 - t.confidence
    judged = []
    for c in results:
        if weak is not None and c.baseline < weak:
            c.status = f"not judged: the baseline scores {c.baseline:.2f}, below gate.min_baseline_accuracy"
        elif c.baseline < limit:
            c.status = f"not judged: the baseline scores {c.baseline:.2f}, below gate.min_cell_accuracy"
        else:
            judged.append(c)
    family = len(judged)
    first = alpha if t.multiplicity == "none" else alpha / max(family, 1)
    need = cell_samples(limit, first)
    pvalues = []
    for c in judged:
        scores = scores_of[c.variant, c.cell]
        if c.n < need:
            c.status = f"not judged: {c.n} samples, a failure here can be shown from {need}"
            pvalues.append(math.nan)
        elif is_binary(scores):
            c.p = binomtest(int(sum(scores)), c.n, limit, alternative="less").pvalue
            pvalues.append(c.p)
        elif np.std(scores) > 0:
            c.p = float(ttest_1samp(scores, limit, alternative="less").pvalue)
            pvalues.append(c.p)
        else:
            c.p = 0.0 if scores[0] < limit else 1.0  # every sample scored the same
            pvalues.append(c.p)
    for c, bad in zip(judged, adjust(pvalues, alpha, t.multiplicity), strict=True):
        if bad:
            c.status = SHOWN_TO_FAIL
    return results


def cell_samples(limit: float, alpha: float) -> int:
    """Samples a cell needs before a policy that gets all of them wrong is shown below `limit` at `alpha`."""
    if limit <= 0:
        return 10**9
    if limit >= 1:
        return 1
    return max(1, math.ceil(math.log(alpha) / math.log(limit) - 1e-12))


def plan(t, variants: int = 1, cells: int = 1) -> list[str]:
    """What a PASS needs at these thresholds: samples per variant at several loss rates, and per cell."""
    alpha = 1 - t.confidence
    first = alpha / variants if t.multiplicity != "none" and variants > 1 else alpha
    at = replace(t, confidence=1 - first, min_samples=0)
    lines = [
        f"gate: margin max_drop={t.max_drop}, max_flip_rate={t.max_flip_rate}, one-sided confidence "
        f"{t.confidence:.0%}, multiplicity {t.multiplicity} over {variants} variant(s) and {cells} cell(s) each",
        "",
        "samples per variant for a PASS, if the policy loses (and never gains) at the rate below:",
    ]
    for rate in PLAN_LOSS_RATES:
        scale = 100_000
        need = fewest_samples(round(rate * scale), 0, scale, at, True)
        per_cell = "" if need is None else f" ({math.ceil(need / cells)} per cell)"
        lines.append(f"  loss rate {rate:>5.1%}: " + (f"{need} samples{per_cell}" if need else "no PASS possible"))
    if t.min_cell_accuracy is not None:
        family = variants * cells
        k = cell_samples(t.min_cell_accuracy, alpha / family if t.multiplicity != "none" else alpha)
        lines += [
            "",
            f"per cell: {k} samples before a cell whose answers are all wrong is shown below "
            f"min_cell_accuracy={t.min_cell_accuracy} ({family} cells in the family); smaller cells are not judged",
        ]
    lines.append(f"\ndefault gate.min_samples (a PASS with no loss at all): {min_samples(t)}")
    return lines
