"""What a row of samples.jsonl must be once written, read back by whoever reads it (the gate, a resumed run): on
its own (`row_problem`: the fields every row has, scores and bytes finite numbers in range, the shapes of the fields
the gate reads) and against the baseline row of its sample (`contradictions`: what `pair` wrote there, re-derived),
and a run.json's servers each its own (`shared_endpoints`). Each answer is a sentence that names the field; None
when nothing is wrong.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
from typing import Any
from urllib.parse import urlsplit

from evalkit.records.schema import BASELINE, Row, flip, is_number

# What every row has, and the gate reads
ROW_FIELDS = (
    "sample_id",
    "variant",
    "score",
    "baseline_score",
    "cell",
    "kv_bytes",
    "kv_bytes_baseline",
    "peak_kv_bytes",
)
SCORE_RANGE = (0.0, 1.0)  # every evalkit scorer's, and what the gate's bounds assume
SCORES = ("score", "baseline_score")
BYTES = ("kv_bytes", "kv_bytes_baseline", "peak_kv_bytes")
OPTIONAL_BYTES = (
    "kv_bytes_deployed",
    "kv_bytes_baseline_deployed",
    "kv_bytes_fp16_same_tokens",
    "kv_bytes_final",
    "prefill_peak_kv_bytes",
    "decode_peak_kv_bytes_deployed",
    "decode_peak_kv_bytes_baseline_deployed",
)
FIDELITY = {"kl_mean": (0.0, math.inf), "top1_agreement": (0.0, 1.0)}
EDITED = "the records were edited or mixed: restore the run's own files, or rerun it"
BYTES_TOLERANCE = 0.02  # ragged layers record their mean tokens per head to 2 decimals


def row_problem(row: dict) -> str | None:
    """What is wrong with one row on its own (scan_rows' check): a score or a byte count that is not a finite number
    in its range; None when nothing is."""
    for key in SCORES:
        v = row[key]
        if not is_number(v):
            return f"has {key}={v!r}, not a number"
        if not (math.isfinite(v) and SCORE_RANGE[0] <= v <= SCORE_RANGE[1]):
            return f"has {key}={v!r}, outside the scorers' range [0, 1]"
    for key in BYTES + OPTIONAL_BYTES:
        if key not in row or (key in OPTIONAL_BYTES and row[key] is None):
            continue
        v = row[key]
        if not is_number(v) or not math.isfinite(v) or v < 0:
            return f"has {key}={v!r}, not a finite number of bytes >= 0"
    if row["kv_bytes_baseline"] <= 0:
        return f"has kv_bytes_baseline={row['kv_bytes_baseline']!r}: the full cache holds some bytes"
    for key, (lo, hi) in FIDELITY.items():
        v = row.get(key)
        if v is not None and (not is_number(v) or not (math.isfinite(v) and lo <= v <= hi)):
            return f"has {key}={v!r}, not a number in [{lo}, {hi}]"
    if not isinstance(row["cell"], dict):
        return f"has cell={row['cell']!r}, not an object"
    if not all(v is None or isinstance(v, (str, int, float, bool)) for v in row["cell"].values()):
        return f'has cell={row["cell"]!r}: a cell\'s values are single numbers or strings (e.g. {{"depth": 0.5}})'
    return _shape(row)


# Fields the gate reads beyond ROW_FIELDS, each with what it must be when present: (test, what it is, an example)
SHAPES = {
    "variant": (lambda v: isinstance(v, str) and v != "", "a variant's name", '"snapkv@0.25"'),
    "policy": (lambda v: isinstance(v, dict), "an object, the policy's settings", '{"name": "h2o", "budget": 0.25}'),
    "quant": (lambda v: v is None or isinstance(v, dict), "an object or null", "null"),
    "prefill": (lambda v: v is None or isinstance(v, dict), "an object or null", '{"mode": "oneshot"}'),
    "compression_asked": (lambda v: isinstance(v, bool), "true or false", "true"),
    "context_tokens": (lambda v: v is None or (_count(v) and v > 0), "a whole number of tokens > 0", "128"),
    "prefill_peak_tokens": (lambda v: v is None or _count(v), "a whole number of tokens", "128"),
    "prefill_bound_tokens": (lambda v: v is None or _count(v), "a whole number of tokens or null", "null"),
    "tokens_held_per_layer": (
        lambda v: v is None or (isinstance(v, list) and all(is_number(x) and x >= 0 for x in v)),
        "a list of token counts >= 0, one a layer, or null",
        "[128, 128, 128]",
    ),
    "tokens_allowed_per_layer": (
        lambda v: v is None or (isinstance(v, list) and all(is_number(x) and x >= 0 for x in v)),
        "a list of token counts >= 0, one a layer, or null",
        "[128, 128, 128]",
    ),
    "evidence_retained_per_layer": (
        lambda v: v is None or (isinstance(v, list) and all(is_number(x) and 0 <= x <= 1 for x in v)),
        "a list of shares in [0, 1], one a layer, or null",
        "[1.0, 0.5, 1.0]",
    ),
}


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(row: dict) -> str | None:
    """A field the gate reads that is not what evalkit writes there (a string for the policy's settings, a list
    with a null in it): named, with what it should be."""
    for key, (fits, what, example) in SHAPES.items():
        if key in row and not fits(row[key]):
            return f"has {key}={row[key]!r}, not {what} (e.g. {example})"
    if row.get("prefill_bound_tokens") is not None and row.get("prefill_peak_tokens") is None:
        return (
            f"has prefill_bound_tokens={row['prefill_bound_tokens']!r} but no prefill_peak_tokens: the bound of a "
            "chunked prefill is checked against the peak it held"
        )
    return None


def contradictions(rows: list[Row], lines: list[int], path: str) -> list[str]:
    """Each variant row against the baseline row of its sample in the same file, and against its own fields."""
    base = {r.sample_id: (r, n) for r, n in zip(rows, lines, strict=True) if r.variant == BASELINE}
    documents: dict[str, tuple[Any, int]] = {}  # context_id -> (its first row's document_id, that row's line)
    out = []
    for r, n in zip(rows, lines, strict=True):
        if r.variant == BASELINE:
            why = _budget(r)
        elif r.sample_id in base:
            b, bn = base[r.sample_id]
            why = _against_baseline(r, b, bn) or _budget(r) or _bytes(r, b)
        else:
            continue  # no baseline row: check_rows says so
        why = why or _document(r, documents, n)
        if why:
            out.append(f"{path}:{n}: {why}; {EDITED}")
    return out


def _document(r: Row, documents: dict[str, tuple[Any, int]], line: int) -> str | None:
    """A row's document_id where it can be re-derived: the prefilled context outside query_aware, and the document of
    every other row prefilled from the same context."""
    cid, doc = r.get("context_id"), r.get("document_id")
    if cid is None or doc is None:
        return None
    if r.protocol != "query_aware" and doc != cid:
        return (
            f"document_id={doc!r}, but under protocol={r.get('protocol')} the prefilled context is the document "
            f"(context_id={cid!r})"
        )
    first, first_line = documents.setdefault(str(cid), (doc, line))
    if doc != first:
        return f"document_id={doc!r}, but line {first_line}, prefilled from the same context {cid!r}, has {first!r}"
    return None


def _against_baseline(r: Row, b: Row, line: int) -> str | None:
    checks = [
        ("baseline_score", b.score, "the baseline row's score"),
        ("kv_bytes_baseline", b["kv_bytes"], "the baseline row's kv_bytes"),
    ]
    for key in ("kv_bytes_deployed", "decode_peak_kv_bytes_deployed"):  # the baseline's deployed bytes, as it held them
        mine = key.replace("_deployed", "_baseline_deployed")
        if mine in r and key in b:
            checks.append((mine, b[key], f"the baseline row's {key}"))
    for key in ("context_id", "document_id", "answers", "scorer"):  # one sample: one context, document, reference
        if key in r or key in b:
            checks.append((key, b.get(key), f"the baseline row's {key}"))
    for key, want, what in checks:
        if r.get(key) != want:
            return f"{key}={r.get(key)!r} but {what} (line {line}) is {want!r}"
    if r.flip is not None or "kl_mean" not in r:  # teacher-forced fidelity rows record no flip
        derived = flip(r.score, b.score)
        if r.flip != derived:
            return f"flip={r.get('flip')!r}, but score {r['score']} against the baseline's {b['score']} is {derived!r}"
    return None


def _budget(r: Row) -> str | None:
    """Tokens held within what the policy contract allowed, summed over the layers."""
    held, allowed = r.get("tokens_held_per_layer"), r.get("tokens_allowed_per_layer")
    if not isinstance(held, list) or not isinstance(allowed, list):
        return None
    if len(held) != len(allowed) or not all(is_number(x) and math.isfinite(x) and x >= 0 for x in held + allowed):
        return "tokens_held_per_layer and tokens_allowed_per_layer are not one count >= 0 per layer each"
    if sum(held) > sum(allowed) + len(held):  # one token a layer: the rounding of per-layer budgets
        return (
            f"tokens_held_per_layer sums to {sum(held):g}, over the {sum(allowed):g} its budget and declared protected "
            "tokens allow (tokens_allowed_per_layer)"
        )
    return None


def _bytes(r: Row, b: Row) -> str | None:
    """Deployed bytes that match the tokens held: dense, the baseline's bytes per token and layer times the tokens
    held; quantized, at most that. The cache decoded from holds at least the compressed context it started from."""
    peak, context = r.get("decode_peak_kv_bytes_deployed"), r.get("kv_bytes_deployed")
    if is_number(peak) and is_number(context) and peak < context:
        return (
            f"decode_peak_kv_bytes_deployed={peak} is below its kv_bytes_deployed={context}: the cache an answer is "
            "decoded from holds at least the compressed context it starts from"
        )
    held, full = r.get("tokens_held_per_layer"), b.get("tokens_held_per_layer")
    deployed, full_bytes = r.get("kv_bytes_deployed"), b.get("kv_bytes_deployed")
    if not (isinstance(held, list) and isinstance(full, list) and is_number(deployed) and is_number(full_bytes)):
        return None
    if len(held) != len(full) or not sum(full) or not all(is_number(x) for x in held + full):
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


def server(url: str) -> tuple[str, int, str] | str:
    """What names one server in a URL, whatever the spelling: the host (every loopback and unspecified address,
    `localhost`, 127.0.0.2, 0.0.0.0, ::1, as one; an IP address in its canonical form; a name lowercased), the port
    (the scheme's default when none is written) and the path with `.`, `..` and trailing slashes resolved. A URL that
    does not parse is its own lowercased text."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        return url.strip().rstrip("/").lower()
    host = (parts.hostname or "").rstrip(".").lower()
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if host == "localhost" or host.endswith(".localhost") or (ip is not None and (ip.is_loopback or ip.is_unspecified)):
        host = "loopback"
    elif ip is not None:
        host = ip.compressed
    return host, port, posixpath.normpath("/" + parts.path.lstrip("/"))


def shared_endpoints(endpoints: Any) -> str | None:
    """Where two variants of a backend=openai run name one server (the same URL, a trailing slash aside), which
    variants; None when each has its own."""
    if not isinstance(endpoints, dict):
        return None
    seen: dict[Any, str] = {}
    for name, url in endpoints.items():
        key = server(str(url))
        if key in seen:
            return f"endpoints {seen[key]!r} and {name!r} are the same server ({url})"
        seen[key] = name
    return None
