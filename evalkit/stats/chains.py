"""One error rate for a search: ordered chains of hypotheses (each policy's budgets, from the largest down), tested
in order within a chain and sharing the level across chains.

Within a chain the hypotheses are tested in a fixed sequence, each at the chain's whole level, and the chain stops at
the first one not rejected: no level is spent on a budget below one not shown safe, so a smaller budget is never
reported safe after a larger one was not, however small its own p-value. Across chains the level is shared by the
graphical procedure of Bretz, Maurer, Brannath and Posch (2009, "A graphical approach to sequentially rejective
multiple test procedures", Stat Med 28:586-604): each chain starts with alpha / k; a chain whose every hypothesis is
rejected hands its level on to the chains still going, in equal parts, and they are tested again at their larger
level (`holm`: with chains of one hypothesis each this is Holm's step-down). `bonferroni` keeps alpha / k for each
chain, `none` gives every chain the whole alpha. The procedure is consonant: the hypotheses it rejects do not depend
on the order in which it finds them, and the family-wise error rate over all chains is at most alpha.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from evalkit.stats import MULTIPLICITY

PROCEDURE = {
    "holm": "fixed sequence within each policy (largest budget first), Holm across policies by the graphical "
    "procedure (Bretz et al. 2009: a policy safe at every budget hands its level to the others)",
    "bonferroni": "fixed sequence within each policy (largest budget first), Bonferroni across policies",
    "none": "fixed sequence within each policy (largest budget first), no correction across policies",
}


@dataclass
class ChainResult:
    rejected: int  # how many of the chain's hypotheses, from its first, are rejected
    levels: list[float]  # the level each hypothesis was (or would have been) tested at; 0 below the first kept


def test_chains(chains: list[list[float]], alpha: float, method: str) -> list[ChainResult]:
    """Each chain's rejections, from its first hypothesis on, and the level each hypothesis was tested at.
    `chains`: per chain, its p-values in the order they are tested (NaN: never rejected, e.g. a budget shown to fail
    on other grounds)."""
    if method not in MULTIPLICITY:
        raise ValueError(f"multiplicity={method!r} is not one of {list(MULTIPLICITY)}")
    k = len(chains)
    weight = [1.0 if method == "none" else 1.0 / k] * k
    out = [ChainResult(0, [0.0] * len(chain)) for chain in chains]
    active = {i for i in range(k) if chains[i]}
    while True:
        for i in active:
            out[i].levels[out[i].rejected] = weight[i] * alpha  # the level its next hypothesis is tested at now
        hit = next((i for i in sorted(active) if _rejects(chains[i][out[i].rejected], weight[i] * alpha)), None)
        if hit is None:
            return out
        out[hit].rejected += 1
        if out[hit].rejected == len(chains[hit]):
            active.discard(hit)
            if method == "holm" and active:
                for j in active:
                    weight[j] += weight[hit] / len(active)
            weight[hit] = 0.0


def _rejects(p: float, level: float) -> bool:
    return not math.isnan(p) and p <= level
