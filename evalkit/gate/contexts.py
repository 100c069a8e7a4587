"""The unit of evidence is the document: a variant's paired rows grouped by the document their questions were asked
on, one value per document.

Questions on one document share its fate (task=hf with several questions on a document): if compression dropped the
passage they need they fail together, whether they share one prefill (protocol=query_agnostic) or each compress the
document with their own question (query_aware). So they are one observation, not several: every statistic of the gate
is a mean over documents of the per-document mean. A row names its document by `document_id` (a digest of the token
ids before the question, evalkit.tasks.prompt); a row without one (records written before it was recorded) by its
`context_id`, which is the document under query_agnostic (evalkit.records.evidence refuses query_aware rows without
one); a row with neither is its own document. With one question per document every number is the per-question one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from evalkit.records import Row
from evalkit.records.summary import cell_key
from evalkit.thresholds import GRADED_FLIP_DELTA

# A row's KL counts up to this many times gate.max_mean_kl (3 nats at the default), so that the judged quantity is
# bounded (evalkit.stats.betting): a PASS bounds the mean of min(KL, cap), which is the mean KL while no row exceeds
# the cap, and the share of rows above it (gate.max_kl_tail_share); a FAIL bounds the mean KL itself from below, which
# needs no cap (KL >= 0). At 10 x, 3% of rows at 3 nats (a true mean at the limit) counted
# as 1 nat each and PASSed 96% of the time at 300 documents.
KL_CAP_FACTOR = 30


@dataclass
class Contexts:
    """One variant's rows as documents: per document, means over its questions (arrays of the same length). The
    gate's messages call a document a context."""

    ids: list[str]  # the documents
    questions: np.ndarray  # questions asked on each document
    drop: np.ndarray  # baseline minus policy score, in [-1, 1]
    lost: np.ndarray  # share of its questions lost: right to wrong, or a graded score down by more than the delta
    gained: np.ndarray  # share gained, the same way up
    policy: np.ndarray  # the policy's score, in [0, 1]
    baseline: np.ndarray
    kl: np.ndarray | None  # KL at the answer tokens, capped and divided by the cap: in [0, 1]; None without KL rows
    binary: bool  # every score 0 or 1
    kl_above: np.ndarray | None = None  # share of its rows whose KL is above the cap (None without KL rows)
    kl_raw: np.ndarray | None = None  # mean KL of its rows in nats, uncapped (None without KL rows)

    @property
    def n(self) -> int:
        """Documents."""
        return len(self.ids)

    @property
    def single(self) -> bool:
        """One question per document: every number is the per-question one."""
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


def document_of(row: Row, index: int) -> str:
    """The document a row's question was asked on: its `document_id`, else its `context_id` (the same digest under
    query_agnostic, so rows of a run resumed after evalkit began to record documents group alike), else a key of
    its own."""
    for key in ("document_id", "context_id"):
        if row.get(key) is not None:
            return str(row[key])
    return f"row #{index} (sample {row.sample_id})"


def group(rows: list[Row], flip_delta: float = GRADED_FLIP_DELTA, kl_cap: float | None = None) -> Contexts:
    """A variant's rows (each with score and baseline_score, paired) as documents, in order of first appearance.

    A flip is a score that falls (lost) or rises (gained) by more than `flip_delta`: for 0/1 scores, right to wrong
    and wrong to right. `kl_cap`: cap each row's `kl_mean` there (None: no KL)."""
    order: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        order.setdefault(document_of(r, i), []).append(i)
    base = np.array([float(r.baseline_score) for r in rows])
    pol = np.array([float(r.score) for r in rows])
    diff = base - pol
    kl = above = raw = None
    if kl_cap is not None and rows and all(_finite(r.get("kl_mean")) for r in rows):
        raw = np.maximum(np.array([float(r["kl_mean"]) for r in rows]), 0.0)
        kl, above = np.minimum(raw, kl_cap) / kl_cap, (raw > kl_cap).astype(float)
    members = list(order.values())
    which = np.zeros(len(rows), dtype=int)  # each row's document, numbered in order of first appearance
    for d, idx in enumerate(members):
        which[idx] = d
    questions = np.array([len(idx) for idx in members], dtype=int)

    def mean(x: np.ndarray) -> np.ndarray:
        return np.bincount(which, weights=x, minlength=len(members)) / questions if members else np.zeros(0)

    return Contexts(
        ids=list(order),
        questions=questions,
        drop=mean(diff),
        lost=mean((diff > flip_delta).astype(float)),
        gained=mean((-diff > flip_delta).astype(float)),
        policy=mean(pol),
        baseline=mean(base),
        kl=None if kl is None else mean(kl),
        binary=bool(np.all(np.isin(base, (0.0, 1.0))) and np.all(np.isin(pol, (0.0, 1.0)))),
        kl_above=None if above is None else mean(above),
        kl_raw=None if raw is None else mean(raw),
    )


def by_cell(rows: list[Row]) -> dict[str, list[Row]]:
    """A variant's rows per cell (evalkit.records.summary.cell_key), cells sorted."""
    cells: dict[str, list[Row]] = {}
    for r in rows:
        cells.setdefault(cell_key(r.cell), []).append(r)
    return dict(sorted(cells.items()))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
