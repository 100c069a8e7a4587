"""Every lost sample of the report: what the variant answered, what the answer was, the evidence each layer kept,
and a link to the line of samples.jsonl that records it, every text cut to a size a page can hold."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from evalkit.html import accuracy_colour
from evalkit.records import Row
from evalkit.records.merged import group_of, is_baseline, label_order
from evalkit.records.schema import flip_cause
from evalkit.records.summary import cell_key
from evalkit.report.data import Line, line_of

NOT_MEASURED = "not measured"


def lost_samples(rows: list[Row], lines: dict[tuple, Line], out: Path) -> list[dict[str, Any]]:
    """Every sample a variant lost (it scores below the baseline's row for the same sample), with what it answered,
    what the answer was, the evidence each layer kept, and the line of samples.jsonl that records it."""
    base: dict[tuple, dict] = {}
    for r in rows:
        if is_baseline(r.variant):
            base.setdefault((group_of(r.variant), r.sample_id), r)
    lost = []
    for r in sorted(rows, key=lambda r: (label_order(r.variant), cell_key(r.cell), str(r.sample_id))):
        if is_baseline(r.variant):
            continue
        b = base.get((group_of(r.variant), r.sample_id))
        if not r.score < (b.score if b else r.baseline_score):
            continue
        lost.append(_lost_row(r, b, line_of(r, lines), out))
    return lost


SHOWN_CHARS = 2000  # a text of a row is shown cut here, with its length: one 30 MB prediction must not swell the page


def _text(value: Any) -> str:
    """A row's field as the page shows it: a string, strings joined, or JSON; cut (_cut)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _cut(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return _cut(" | ".join(value))
    return _cut(json.dumps(value, ensure_ascii=False, default=str))


def _cut(text: str) -> str:
    """`text` whole, or its first SHOWN_CHARS characters and how long it is."""
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... [cut: {len(text)} characters in all]"


def _cut_strings(value: Any) -> Any:
    """A row with each of its strings cut (_cut), for the row shown whole beside a lost sample."""
    if isinstance(value, str):
        return _cut(value)
    if isinstance(value, list):
        return [_cut_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: _cut_strings(v) for k, v in value.items()}
    return value


def _href(path: Path, out: Path) -> str:
    """A link from the page in `out` to `path`: relative and percent-encoded, so never a URL of its own (a folder
    named `javascript:...` would otherwise be a script the link runs)."""
    return quote(Path(os.path.relpath(path.resolve(), out.resolve())).as_posix())


def _lost_row(r: Row, b: Row | None, line: Line | None, out: Path) -> dict[str, Any]:
    retained = r.get("evidence_retained_per_layer")
    retained = retained if isinstance(retained, list) and retained else None
    cause = flip_cause({**r, "flip": "lost"}) or NOT_MEASURED
    source = None
    if line is not None:
        pretty = json.dumps(_cut_strings(json.loads(line.text)), indent=1, ensure_ascii=False, sort_keys=True)
        source = {"href": _href(line.path, out), "label": f"{line.path.parent.name}/{line.path.name}:{line.number}",
                  "path": str(line.path), "line": line.number, "row": pretty}  # fmt: skip
    return {
        "variant": r.variant,
        "cell": cell_key(r.cell),
        "cause": cause,
        "sample_id": str(r.sample_id),
        "context_id": r.get("context_id"),
        "question": _text(r.get("question")),
        "prediction": _text(r["prediction"] if "prediction" in r else r.get("response")),
        "answers": _text(r.get("answers")),
        "baseline_prediction": _text(b.get("prediction", b.get("response"))) if b else "",
        "score": r.score,
        "baseline_score": b.score if b else r.baseline_score,
        "evidence": [{"layer": i, "value": v, "colour": accuracy_colour(v)} for i, v in enumerate(retained or [])],
        "source": source,
    }
