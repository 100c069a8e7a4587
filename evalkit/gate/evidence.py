"""What the gate re-derives from the records, and refuses when the records contradict it.

The gate believes no number a row claims that it can derive from another row or from run.json:

- a variant row's `baseline_score`, `flip`, `kv_bytes_baseline`, `context_id` and `document_id` must equal what the
  baseline row of the same sample in the same file says (its `score`, the flip the two scores make, its `kv_bytes`,
  its context and document);
- a document is the gate's unit (evalkit.gate.contexts): rows that share a prefilled context share its document, and
  outside protocol=query_aware the prefilled context is the document (`document_id` equals `context_id`);
- scores are finite and within the scorers' range [0, 1]; KV bytes finite and non-negative, the full cache's above 0;
- a variant's tokens held, summed over its layers, are within what its policy contract allowed (`tokens_allowed_per
  _layer`, the budget plus the tokens the policy declares protected, evalkit.kv.contract), and its deployed bytes match
  the tokens it holds (dense storage: the baseline's bytes per token and layer times the tokens held; quantized
  storage: at most that);
- run.json carries the resolved config, the model fingerprint and the library versions;
- a sample is identified across folders by its run's sample identity and its id (evalkit.records.sample_key), so
  that rows of different runs whose ids collide are never taken for the same sample (evalkit.analysis.merge).

Each contradiction names `file:line` and the field; the gate then says CANNOT JUDGE (exit 2).
"""

from __future__ import annotations

import math
from typing import Any

from evalkit.records import BASELINE

SCORE_RANGE = (0.0, 1.0)  # every evalkit scorer's, and what the gate's bounds assume
SCORES = ("score", "baseline_score")
BYTES = ("kv_bytes", "kv_bytes_baseline", "peak_kv_bytes")
OPTIONAL_BYTES = ("kv_bytes_deployed", "kv_bytes_baseline_deployed", "kv_bytes_fp16_same_tokens", "kv_bytes_final")
FIDELITY = {"kl_mean": (0.0, math.inf), "top1_agreement": (0.0, 1.0)}
RUN_NEEDS = (
    ("config", dict),
    ("model.fingerprint", str),
    ("versions.torch", str),
    ("versions.transformers", str),
    ("versions.evalkit", str),
)
EDITED = "the records were edited or mixed: restore the run's own files, or rerun it"
BYTES_TOLERANCE = 0.02  # ragged layers record their mean tokens per head to 2 decimals


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def row_problem(row: dict) -> str | None:
    """What is wrong with one row on its own (scan_rows' check): a score or a byte count that is not a finite number
    in its range; None when nothing is."""
    for key in SCORES:
        v = row[key]
        if not _number(v):
            return f"has {key}={v!r}, not a number"
        if not (math.isfinite(v) and SCORE_RANGE[0] <= v <= SCORE_RANGE[1]):
            return f"has {key}={v!r}, outside the scorers' range [0, 1]"
    for key in BYTES + OPTIONAL_BYTES:
        if key not in row or (key in OPTIONAL_BYTES and row[key] is None):
            continue
        v = row[key]
        if not _number(v) or not math.isfinite(v) or v < 0:
            return f"has {key}={v!r}, not a finite number of bytes >= 0"
    if row["kv_bytes_baseline"] <= 0:
        return f"has kv_bytes_baseline={row['kv_bytes_baseline']!r}: the full cache holds some bytes"
    for key, (lo, hi) in FIDELITY.items():
        v = row.get(key)
        if v is not None and (not _number(v) or not (math.isfinite(v) and lo <= v <= hi)):
            return f"has {key}={v!r}, not a number in [{lo}, {hi}]"
    if not isinstance(row["cell"], dict):
        return f"has cell={row['cell']!r}, not an object"
    return None


def flip(score: float, base_score: float) -> str | None:
    """`lost` when the variant scores below the baseline on the sample, `gained` above, None when equal."""
    return None if score == base_score else ("lost" if score < base_score else "gained")


def contradictions(rows: list[dict], lines: list[int], path: str) -> list[str]:
    """Each variant row against the baseline row of its sample in the same file, and against its own fields."""
    base = {r["sample_id"]: (r, n) for r, n in zip(rows, lines, strict=True) if r["variant"] == BASELINE}
    documents: dict[str, tuple[Any, int]] = {}  # context_id -> (its first row's document_id, that row's line)
    out = []
    for r, n in zip(rows, lines, strict=True):
        if r["variant"] == BASELINE:
            why = _budget(r)
        elif r["sample_id"] in base:
            b, bn = base[r["sample_id"]]
            why = _against_baseline(r, b, bn) or _budget(r) or _bytes(r, b)
        else:
            continue  # no baseline row: check_rows says so
        why = why or _document(r, documents, n)
        if why:
            out.append(f"{path}:{n}: {why}; {EDITED}")
    return out


def _document(r: dict, documents: dict[str, tuple[Any, int]], line: int) -> str | None:
    """A row's document_id where it can be re-derived: the prefilled context outside query_aware, and the document of
    every other row prefilled from the same context."""
    cid, doc = r.get("context_id"), r.get("document_id")
    if cid is None or doc is None:
        return None
    if r.get("protocol") != "query_aware" and doc != cid:
        return (
            f"document_id={doc!r}, but under protocol={r.get('protocol')} the prefilled context is the document "
            f"(context_id={cid!r})"
        )
    first, first_line = documents.setdefault(str(cid), (doc, line))
    if doc != first:
        return f"document_id={doc!r}, but line {first_line}, prefilled from the same context {cid!r}, has {first!r}"
    return None


def undocumented(rows: list[dict], where: str) -> list[str]:
    """protocol=query_aware rows without a document_id: each question compressed its document with it, so their
    contexts differ per question and the gate cannot tell which questions share a document (the unit)."""
    bare = [r for r in rows if r.get("protocol") == "query_aware" and r.get("document_id") is None]
    if not bare:
        return []
    return [
        f"{where}: {len(bare)} protocol=query_aware rows without document_id (sample {bare[0]['sample_id']!r} "
        "first): the gate cannot tell which questions were asked on one document, its unit; rerun the run with "
        "this evalkit, which records each row's document"
    ]


def _against_baseline(r: dict, b: dict, line: int) -> str | None:
    checks = [
        ("baseline_score", b["score"], "the baseline row's score"),
        ("kv_bytes_baseline", b["kv_bytes"], "the baseline row's kv_bytes"),
    ]
    if "kv_bytes_baseline_deployed" in r and "kv_bytes_deployed" in b:
        checks.append(("kv_bytes_baseline_deployed", b["kv_bytes_deployed"], "the baseline row's kv_bytes_deployed"))
    for key in ("context_id", "document_id"):
        if key in r or key in b:
            checks.append((key, b.get(key), f"the baseline row's {key}"))
    for key, want, what in checks:
        if r.get(key) != want:
            return f"{key}={r.get(key)!r} but {what} (line {line}) is {want!r}"
    if r.get("flip") is not None or "kl_mean" not in r:  # teacher-forced fidelity rows record no flip
        derived = flip(r["score"], b["score"])
        if r.get("flip") != derived:
            return f"flip={r.get('flip')!r}, but score {r['score']} against the baseline's {b['score']} is {derived!r}"
    return None


def _budget(r: dict) -> str | None:
    """Tokens held within what the policy contract allowed, summed over the layers."""
    held, allowed = r.get("tokens_held_per_layer"), r.get("tokens_allowed_per_layer")
    if not isinstance(held, list) or not isinstance(allowed, list):
        return None
    if len(held) != len(allowed) or not all(_number(x) and math.isfinite(x) and x >= 0 for x in held + allowed):
        return "tokens_held_per_layer and tokens_allowed_per_layer are not one count >= 0 per layer each"
    if sum(held) > sum(allowed) + len(held):  # one token a layer: the rounding of per-layer budgets
        return (
            f"tokens_held_per_layer sums to {sum(held):g}, over the {sum(allowed):g} its budget and declared protected "
            "tokens allow (tokens_allowed_per_layer)"
        )
    return None


def _bytes(r: dict, b: dict) -> str | None:
    """Deployed bytes that match the tokens held: dense, the baseline's bytes per token and layer times the tokens
    held; quantized, at most that."""
    held, full = r.get("tokens_held_per_layer"), b.get("tokens_held_per_layer")
    deployed, full_bytes = r.get("kv_bytes_deployed"), b.get("kv_bytes_deployed")
    if not (isinstance(held, list) and isinstance(full, list) and _number(deployed) and _number(full_bytes)):
        return None
    if len(held) != len(full) or not sum(full) or not all(_number(x) for x in held + full):
        return None
    dense = full_bytes / sum(full) * sum(held)
    over = deployed > dense * (1 + BYTES_TOLERANCE)
    under = not r.get("quant") and deployed < dense * (1 - BYTES_TOLERANCE)
    if over or under:
        return (
            f"kv_bytes_deployed={deployed} but its {sum(held):g} tokens held take {dense:.0f} bytes at the baseline's "
            f"{full_bytes / sum(full):.1f} bytes per token and layer" + ("" if r.get("quant") else " (dense storage)")
        )
    return None


def run_problems(info: dict, path: str) -> list[str]:
    """What a run.json lacks that the gate needs: its config, the model fingerprint, the library versions."""
    missing = []
    for dotted, kind in RUN_NEEDS:
        node: Any = info
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, kind) or not node:
            missing.append(dotted)
    if not missing:
        return []
    return [
        f"{path}: lacks {', '.join(missing)}: the gate compares runs by their config, model weights and library "
        "versions; judge the run.json its run wrote, or rerun it"
    ]
