"""The gate's statistical decisions: for each variant PASS, FAIL or INCONCLUSIVE, and for each cell whether it is
shown to fail, counted in contexts (evalkit.gate.contexts), with the error rate held across variants and cells, and over
every look (each judgement is the anytime-valid betting test, evalkit.gate.checks: judging again spends nothing).

A variant PASSes when every check (evalkit.gate.checks: the drop below `max_drop`, the flip rate below `max_flip_rate`,
the capped mean KL below `max_mean_kl`, the share of KL rows above the cap below `max_kl_tail_share`) is shown to
hold: its p-value is the largest of its checks' (an intersection-union test, no correction among them), and the
variants' p-values are corrected together (Holm or Bonferroni, `gate.multiplicity`). A variant FAILs when a check is
shown broken (every claim of a broken check, over all variants and checks, corrected together) or a cell is shown
below `min_cell_accuracy` (the cells corrected together); INCONCLUSIVE otherwise, with the contexts that would settle
it (evalkit.gate.power).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evalkit.gate.checks import Evidence, evaluate, kl_cap, kl_words
from evalkit.gate.contexts import Contexts, by_cell, group
from evalkit.gate.power import betting_cell_samples, contexts_needed, judged_once_lossless, lossless_contexts
from evalkit.records import Row
from evalkit.records.verdict import SHOWN_TO_FAIL
from evalkit.stats import adjust, betting, binary_bounds


@dataclass
class Decision:
    status: str  # PASS, FAIL or INCONCLUSIVE
    fail: list[str] = field(default_factory=list)
    open: list[str] = field(default_factory=list)  # why it is not yet a PASS
    samples_needed: int | None = None  # samples (questions) the next look needs for about 80% power at these rates
    contexts_needed: int | None = None  # the same in contexts, the unit the statistics count
    look: int = 1
    p: float = math.nan  # the variant's p-value for a PASS, before the correction across variants
    uneven: bool = False  # a PASS over its documents held back: over their questions it is not one (question_weighted)
    evidence: Evidence | None = field(default=None, repr=False)


def min_samples(t) -> int:
    """The fewest one-question contexts a variant that loses nothing needs to PASS by betting: the default
    `min_samples` (74 at a 0.05 margin and 95%)."""
    return lossless_contexts(t, 1 - t.confidence)


def floor(t) -> int:
    """gate.min_samples, or the count a lossless PASS needs when it is null."""
    return t.min_samples if t.min_samples is not None else min_samples(t)


def evidence_of(by_variant: dict[str, list[Row]], t) -> dict[str, Evidence]:
    out = {}
    for name in sorted(by_variant):
        ctx = group(by_variant[name], t.graded_flip_delta, kl_cap(t))
        out[name] = evaluate(name, ctx, t, floor(t))
    return out


@dataclass
class Family:
    """How the variants' PASS claims share the error rate: which are shown, the level each was tested at, how the
    messages say it, and why one was not tested at all (a search's budget below one not shown safe)."""

    passed: dict[str, bool]
    levels: dict[str, float]
    words: dict[str, str]  # per variant, after the test's name: "; Holm's correction over 3 variants"
    untested: dict[str, str] = field(default_factory=dict)
    fail_words: str | None = None  # how a FAIL's bound is corrected, where not as `words` says (a search's)


def holm_family(ev: dict[str, Evidence], skip: set[str], t) -> Family:
    """Every variant's PASS claim in one family, Holm or Bonferroni (`gate.multiplicity`). `skip` is not used: a
    variant held back by its own checks still counts in the family as it always has."""
    alpha, names = 1 - t.confidence, list(ev)
    pvalues = [ev[n].p_pass for n in names]
    words = f"; {t.multiplicity.capitalize()}'s correction over {len(names)} variants" if len(names) > 1 else ""
    return Family(
        dict(zip(names, adjust(pvalues, alpha, t.multiplicity), strict=True)),
        dict(zip(names, critical_levels(pvalues, alpha, t.multiplicity), strict=True)),
        dict.fromkeys(names, words),
    )


def critical_levels(pvalues: list[float], alpha: float, method: str) -> list[float]:
    """The level each p-value is compared with (Holm: alpha / (k - rank)), for the messages."""
    k = len(pvalues)
    if method == "none":
        return [alpha] * k
    if method == "bonferroni":
        return [alpha / k] * k
    order = sorted(range(k), key=lambda i: pvalues[i])
    out = [alpha] * k
    for rank, i in enumerate(order):
        out[i] = alpha / (k - rank)
    return out


FamilyOf = Callable[[dict[str, Evidence], set[str], Any], Family]


def variant_decisions(
    by_variant: dict[str, list[Row]], t, look: int = 1, family: FamilyOf = holm_family, blocked: frozenset = frozenset()
) -> dict[str, Decision]:
    """PASS, FAIL or INCONCLUSIVE for every variant, the PASS claims sharing the error rate as `family` has them
    (Holm across variants; a search's chains, evalkit.gate.search). `blocked`: variants shown to fail on other
    grounds (a cell, their records), which a search never tests (`look`: this judgement's number, recorded and
    shown; the statistics do not depend on it)."""
    alpha = 1 - t.confidence
    ev = evidence_of(by_variant, t)
    names = list(ev)
    claims = [c for n in names for c in ev[n].checks]
    for c, bad in zip(claims, adjust([c.p_broken for c in claims], alpha, t.multiplicity), strict=True):
        c.broken = bad
    uneven = {n: question_weighted(n, ev[n].contexts, t) for n in names}
    skip = set(blocked) | {n for n in names if uneven[n] or any(c.broken for c in ev[n].checks)}
    fam = family(ev, skip, t)
    out = {}
    for name in names:
        e, level, words = ev[name], fam.levels[name], fam.words[name]
        for c in e.checks:
            c.holds = c.p_holds <= level
        d = Decision("INCONCLUSIVE", look=look, p=e.p_pass, evidence=e)
        said = words if fam.fail_words is None else fam.fail_words
        d.fail = [fail_message(name, e, c, t, said, look) for c in e.checks if c.broken]
        if not fam.passed[name]:
            d.open = [fam.untested[name]] if name in fam.untested else open_messages(name, e, t, words, look, level)
        d.status = "FAIL" if d.fail else "PASS" if fam.passed[name] else "INCONCLUSIVE"
        if d.status == "PASS" and uneven[name]:
            d.status, d.open, d.uneven = "INCONCLUSIVE", [uneven[name]], True
        elif d.status == "INCONCLUSIVE" and name not in fam.untested:
            d.contexts_needed = contexts_needed(e, t, level=level)
            if d.contexts_needed is not None:
                per = float(np.mean(e.contexts.questions)) if e.contexts.n else 1.0
                d.samples_needed = math.ceil(d.contexts_needed * per)
        out[name] = d
    return out


def question_weighted(name: str, ctx: Contexts, t) -> str | None:
    """Why a PASS on the documents' mean is not one over their questions: where documents carry unequal numbers of
    questions, the drop (or flip rate) over all questions, each document weighed by its questions, beyond the
    threshold (300 questions lost on one document beside 300 one-question documents kept: 1/301 a document, half of
    the questions). None when the documents carry one number of questions, or the questions' figures are within."""
    q = ctx.questions.astype(float)
    if ctx.n == 0 or np.all(q == q[0]):
        return None
    drop, lost = float(np.sum(ctx.drop * q) / q.sum()), float(np.sum(ctx.lost * q) / q.sum())
    over = []
    if t.max_drop is not None and drop > t.max_drop:
        over.append(f"drop {drop:+.3f} over the {t.max_drop} margin")
    if t.max_flip_rate is not None and lost > t.max_flip_rate:
        over.append(f"{lost:.0%} lost, over the {t.max_flip_rate:.0%} flip-rate limit")
    if not over:
        return None
    return (
        f"{name}: shown within the thresholds over its {ctx.n} documents, each weighed once, but over its "
        f"{int(q.sum())} questions, each document weighed by its questions, {' and '.join(over)}: the documents with "
        "more questions lost more, so a deployment that asks many questions of few documents would not see the "
        "documents' figure; judge documents with like numbers of questions, or more documents"
    )


def _units(ctx: Contexts, noun: str = "") -> str:
    """How many were judged: "59" (or "59 samples" with a noun) for one question per context, else "320 questions
    on 21 contexts"."""
    if ctx.single:
        return f"{ctx.n} {noun}".rstrip()
    return f"{int(np.sum(ctx.questions))} questions on {ctx.n} contexts"


def _how(c, t, words: str, look: int) -> str:
    return f"{t.confidence:.0%} {{}} bound, {c.method}, look {look}{words}"


def _flipped(e: Evidence, t) -> str:
    return "flipped from right to wrong" if e.contexts.binary else f"decreased by more than {t.graded_flip_delta}"


def fail_message(name: str, e: Evidence, c, t, words: str, look: int) -> str:
    ctx, how = e.contexts, _how(c, t, words, look).format("lower")
    if c.what == "drop":
        drop = float(ctx.drop.mean())
        return f"{name}: accuracy drop {drop:+.3f}, at least {c.lower:.3f} ({how}): shown over the {c.limit} margin"
    if c.what == "flips":
        lost, q = ctx.lost_questions, int(np.sum(ctx.questions))
        return (
            f"{name}: {lost} of {_units(ctx, 'samples')} {_flipped(e, t)} ({lost / q:.0%}; at least {c.lower:.3f} "
            f"per context, {how}): shown over the {c.limit:.0%} flip-rate limit"
        )
    if c.what == "kl_tail":
        return (
            f"{name}: {_tail(e, c)} ({c.extra['share_above_cap']:.1%}; at least {c.lower:.3f} per context, {how}): "
            f"shown over max_kl_tail_share={c.limit}"
        )
    return f"{name}: mean KL at least {c.lower:.4f} nats ({how}; every row counted in full): over {c.limit}"


def _tail(e: Evidence, c) -> str:
    """The KL rows above the cap, for the kl_tail check's messages."""
    rows, cap = c.extra["rows_above_cap"], c.extra["cap"]
    return f"{rows} of {int(np.sum(e.contexts.questions))} KL rows above the {cap:g}-nat cap"


def open_messages(name: str, e: Evidence, t, words: str, look: int, level: float) -> list[str]:
    ctx, out = e.contexts, []
    for c in e.checks:
        if c.holds or c.broken:
            continue
        how = _how(c, t, words, look).format("upper")
        if c.what == "drop":
            seen = (
                f"{ctx.lost_questions} lost and {ctx.gained_questions} gained of {_units(ctx)}"
                if ctx.binary
                else f"graded scores, mean drop {float(ctx.drop.mean()):+.3f} over {_units(ctx, 'samples')}"
            )
            out.append(
                f"{name}: {seen}: the drop may be as large as {c.upper:.3f} ({how}), not shown below the {c.limit} "
                "margin"
            )
        elif c.what == "flips":
            out.append(
                f"{name}: {ctx.lost_questions} of {_units(ctx, 'samples')} {_flipped(e, t)}: the flip rate may be as "
                f"large as {c.upper:.3f} ({how}), not shown below {c.limit:.0%}"
            )
        elif c.what == "kl_tail":
            out.append(
                f"{name}: {_tail(e, c)}: their share may be as large as {c.upper:.3f} ({how}), not shown below "
                f"max_kl_tail_share={c.limit} (the capped mean does not bound rows beyond the cap: a PASS shows "
                "them rare)"
            )
        else:
            out.append(
                f"{name}: the capped mean KL may be as large as {c.upper:.4f} nats ({how}; {kl_words(c)}), not shown "
                f"below max_mean_kl={c.limit}"
            )
    if ctx.n < e.floor:
        unit = "samples" if ctx.single else "contexts"
        out.append(f"{name}: {ctx.n} {unit}, fewer than gate.min_samples={e.floor}{_cost(t, e.floor)}")
    if not out:
        out.append(f"{name}: p = {e.p_pass:.4f} for a PASS, not shown at its level {level:.4g}{words}")
    return out


def _cost(t, n: int) -> str:
    """What the floor costs, where it is the default: the lossless betting count against a test judged once."""
    once = judged_once_lossless(t)
    if t.min_samples is not None or once is None:
        return ""
    return f" (a lossless PASS needs {n} by betting, which holds at every look; a test judged once would need {once})"


@dataclass
class CellResult:
    variant: str
    cell: str
    n: int  # contexts (samples, with one question per context)
    lost: int
    gained: int
    baseline: float
    policy: float
    bounds: tuple[float, float]  # one-sided bounds on the cell's drop at the gate's confidence
    status: str  # "shown to fail", "no failure shown", "not judged: ..."
    p: float = math.nan


def cell_decisions(by_variant: dict[str, list[Row]], t) -> list[CellResult]:
    """Per variant and cell: is the policy's accuracy shown below `min_cell_accuracy` where the baseline reaches it?
    The betting test at every look, Holm or Bonferroni across all cells judged; a cell too small to ever be shown
    failing at the error rate it is given is `not judged`."""
    results, contexts = [], {}
    for name in sorted(by_variant):
        for cell, rows in by_cell(by_variant[name]).items():
            ctx = group(rows, t.graded_flip_delta)
            contexts[name, cell] = ctx
            lost, gained = ctx.counts()
            bounds = _cell_bounds(ctx, t)
            base, pol = float(ctx.baseline.mean()), float(ctx.policy.mean())
            results.append(CellResult(name, cell, ctx.n, lost, gained, base, pol, bounds, "no failure shown"))
    limit, weak = t.min_cell_accuracy, t.min_baseline_accuracy
    if limit is None:
        for c in results:
            c.status = "not judged: gate.min_cell_accuracy is null"
        return results
    judged = []
    for c in results:
        if weak is not None and c.baseline < weak:
            c.status = f"not judged: the baseline scores {c.baseline:.2f}, below gate.min_baseline_accuracy"
        elif c.baseline < limit:
            c.status = f"not judged: the baseline scores {c.baseline:.2f}, below gate.min_cell_accuracy"
        else:
            judged.append(c)
    alpha = 1 - t.confidence
    budget = alpha if t.multiplicity == "none" else alpha / max(len(judged), 1)
    pvalues = []
    for c in judged:
        ctx = contexts[c.variant, c.cell]
        p, need = _cell_test(ctx, t, budget)
        if c.n < need:
            c.status = f"not judged: {c.n} samples, a failure here can be shown from {need}"
            p = math.nan
        c.p = p
        pvalues.append(p)
    for c, bad in zip(judged, adjust(pvalues, alpha, t.multiplicity), strict=True):
        if bad:
            c.status = SHOWN_TO_FAIL
    return results


def _cell_bounds(ctx: Contexts, t) -> tuple[float, float]:
    if ctx.n == 0:
        return (math.nan, math.nan)
    if ctx.single and ctx.binary:
        return binary_bounds(*ctx.counts(), ctx.n, t.confidence)
    alpha = 1 - t.confidence
    return betting.bound(ctx.drop, alpha, -1, 1, upper=False), betting.bound(ctx.drop, alpha, -1, 1, upper=True)


def _cell_test(ctx: Contexts, t, budget: float) -> tuple[float, int]:
    """(p-value that the cell's accuracy is below the limit, by betting; the contexts before an all-wrong cell can
    show it at `budget`)."""
    limit = t.min_cell_accuracy
    return betting.p_value(ctx.policy, limit, 0.0, 1.0, below=True), betting_cell_samples(limit, budget)


def unjudged_cells(cells: list[CellResult], name: str, t) -> str | None:
    """A line for a verdict where the cell criterion judged none of this variant's cells (and why)."""
    mine = [c for c in cells if c.variant == name]
    if t.min_cell_accuracy is None or not mine or any(not c.status.startswith("not judged") for c in mine):
        return None
    small = [c for c in mine if c.status.startswith("not judged: ") and "can be shown from" in c.status]
    why = f" ({small[0].status.removeprefix('not judged: ')})" if small else ""
    return (
        f"{name}: no cell judged by min_cell_accuracy={t.min_cell_accuracy}{why}: this verdict says nothing about "
        "single cells; run more samples per cell (python -m evalkit.gate --plan --cells N)"
    )


def decision_summary(d: Decision, t) -> dict[str, Any]:
    """What verdict.json and report.md say of a variant's decision: its status, look, p-value, checks and bounds."""
    e = d.evidence
    return {
        "status": d.status,
        "look": d.look,
        "p_pass": d.p,
        "samples_needed": d.samples_needed,
        "contexts_needed": d.contexts_needed,
        "level": t.confidence,
        "contexts": e.contexts.n,
        "questions": int(e.contexts.questions.sum()),
        "method": "betting (anytime-valid)",
        "checks": {
            c.what: {
                "p_holds": c.p_holds,
                "p_broken": c.p_broken,
                "holds": c.holds,
                "broken": c.broken,
                "bounds": [c.lower, c.upper],
                "method": c.method,
                **c.extra,
            }
            for c in e.checks
        },
    }


def look_record(decisions: dict[str, Decision], cells: list[CellResult]) -> dict[str, dict]:
    """Per variant, what this look judged (recorded in looks.jsonl, evalkit.records.looks): an audit trail, checked
    against the rows when they are judged again."""
    out = {}
    for name, d in decisions.items():
        ctx = d.evidence.contexts
        out[name] = {
            "contexts": ctx.n,
            "questions": int(ctx.questions.sum()),
            "cells": {c.cell: c.n for c in cells if c.variant == name},
        }
    return out
