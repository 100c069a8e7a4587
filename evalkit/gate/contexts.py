"""The unit of evidence is what was compressed: a variant's paired rows grouped by the context they were prefilled and
compressed from, one value per context.

Questions answered from one prefill and one compression share their fate (task=hf with several questions on a
document), so they are one observation, not several: every statistic of the gate is a mean over contexts of the
per-context mean. A row names its context by `context_id` (a digest of the prefilled token ids, evalkit.records);
a row without one (records written before it was recorded) is its own context. With one question per context every
number is the per-question one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from evalkit.gate.summary import cell_key

GRADED_FLIP_DELTA = 0.1  # the default gate.graded_flip_delta: a graded score must fall by more than this to count
KL_CAP_FACTOR = 10  # a row's KL counts up to this many times gate.max_mean_kl (a bounded quantity, evalkit.betting)


@dataclass
class Contexts:
    """One variant's rows as contexts: per context, means over its questions (arrays of the same length)."""

    ids: list[str]
    questions: np.ndarray  # questions answered from each context
    drop: np.ndarray  # baseline minus policy score, in [-1, 1]
    lost: np.ndarray  # share of its questions lost: right to wrong, or a graded score down by more than the delta
    gained: np.ndarray  # share gained, the same way up
    policy: np.ndarray  # the policy's score, in [0, 1]
    baseline: np.ndarray
    kl: np.ndarray | None  # KL at the answer tokens, capped and divided by the cap: in [0, 1]; None without KL rows
    binary: bool  # every score 0 or 1

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def single(self) -> bool:
        """One question per context: every number is the per-question one."""
        return bool(np.all(self.questions == 1))

    @property
    def lost_questions(self) -> int:
        return int(round(float(np.sum(self.lost * self.questions))))

    @property
    def gained_questions(self) -> int:
        return int(round(float(np.sum(self.gained * self.questions))))

    def counts(self) -> tuple[int, int]:
        """(contexts that lost, contexts that gained), for one question per context the lost and gained samples."""
        return int(np.sum(self.lost > 0)), int(np.sum(self.gained > 0))


def context_of(row: dict, index: int) -> str:
    """The context a row was compressed from: its `context_id`, or a key of its own when the row has none."""
    cid = row.get("context_id")
    return str(cid) if cid is not None else f"row #{index} (sample {row.get('sample_id')})"


def group(rows: list[dict], flip_delta: float = GRADED_FLIP_DELTA, kl_cap: float | None = None) -> Contexts:
    """A variant's rows (each with score and baseline_score, paired) as contexts, in order of first appearance.

    A flip is a score that falls (lost) or rises (gained) by more than `flip_delta`: for 0/1 scores, right to wrong
    and wrong to right. `kl_cap`: cap each row's `kl_mean` there (None: no KL)."""
    order: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        order.setdefault(context_of(r, i), []).append(i)
    base = np.array([float(r["baseline_score"]) for r in rows])
    pol = np.array([float(r["score"]) for r in rows])
    diff = base - pol
    kl = None
    if kl_cap is not None and rows and all(_finite(r.get("kl_mean")) for r in rows):
        kl = np.minimum(np.maximum(np.array([float(r["kl_mean"]) for r in rows]), 0.0), kl_cap) / kl_cap
    members = list(order.values())

    def mean(x: np.ndarray) -> np.ndarray:
        return np.array([x[idx].mean() for idx in members]) if members else np.zeros(0)

    return Contexts(
        ids=list(order),
        questions=np.array([len(idx) for idx in members], dtype=int),
        drop=mean(diff),
        lost=mean((diff > flip_delta).astype(float)),
        gained=mean((-diff > flip_delta).astype(float)),
        policy=mean(pol),
        baseline=mean(base),
        kl=None if kl is None else mean(kl),
        binary=bool(np.all(np.isin(base, (0.0, 1.0))) and np.all(np.isin(pol, (0.0, 1.0)))),
    )


def by_cell(rows: list[dict]) -> dict[str, list[dict]]:
    """A variant's rows per cell (analysis.cell_key), cells sorted."""
    cells: dict[str, list[dict]] = {}
    for r in rows:
        cells.setdefault(cell_key(r["cell"]), []).append(r)
    return dict(sorted(cells.items()))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
