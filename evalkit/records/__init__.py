"""Append-only results: `samples.jsonl` (one row per sample x variant, flushed as each finishes) and `run.json`;
their schema (`Row`, `RunInfo`, the pairing with the baseline) is evalkit.records.schema, what a row read back must
be (on its own and against its baseline row; the gate and a resumed run both check it) evalkit.records.checks, the
paired summary of a run's rows evalkit.records.summary.

A killed run loses at most the row in flight: rows are written whole, flushed and fsynced; a torn last line
left by a kill is cut off when the run resumes. A write that fails (a full disk, a folder made read-only) is undone
to the last whole row and reported as a ConfigError that names the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.records.checks import ROW_FIELDS, row_problem
from evalkit.records.schema import BASELINE, Job, Result, Row, RunInfo, flip, pair, row_error

# the schema, read from here as from its own module
__all__ = ["BASELINE", "Job", "Result", "Row", "RunInfo", "flip", "pair"]

SAMPLES = "samples.jsonl"
RUN = "run.json"
SUMMARY = "summary.json"

# What a task's config holds about how many samples to draw, not which: a run extended with more samples (resume=true
# and a larger count) keeps its identity, and its samples' digests prove the old ones unchanged.
SAMPLE_COUNT = ("samples_per_cell", "limit", "fraction")
KEYS = ("sample_id", "variant")  # what every row has: (sample_id, variant) names it
CORRUPT = "the file was edited or corrupted: fix or delete that line, or move the file away to start the run afresh"


MAX_DEPTH = 64  # objects and lists nested deeper than this in a file evalkit reads: none it writes comes close


def loads(text: str | bytes) -> Any:
    """json.loads for the files evalkit reads (samples.jsonl, run.json, looks.jsonl, verdict.json), with nesting
    deeper than MAX_DEPTH a ValueError like any other bad JSON: Python's parser, and every reader that walks what it
    returns, would otherwise raise RecursionError (100,000 brackets on one line), which no reader expects."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(f"nested deeper than {MAX_DEPTH} levels", "", 0) from None
    if _depth(doc) > MAX_DEPTH:
        raise json.JSONDecodeError(f"nested deeper than {MAX_DEPTH} levels", "", 0)
    return doc


def _depth(doc: Any) -> int:
    """How deep lists and objects nest in `doc` (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # deeper is refused whatever lies below: no need to walk it
            stack += [(c, level + 1) for c in children]
    return deepest


def scan_rows(
    path: Path, required: tuple[str, ...] = KEYS, check: Callable[[dict], str | None] | None = None
) -> tuple[list[dict[str, Any]], list[str], int | None, int, list[int]]:
    """Every row of a samples.jsonl that is a JSON object with the `required` fields (and passes `check`, which says
    what is wrong with a row, e.g. "has score='x', not a number", or None), and what is wrong with the rest.

    Returns (rows, problems, torn, end, lines): each problem names `file:line` and the fix; `torn` is the number of a
    final line with no newline (a write that was killed), None when the file ends whole; `end` is the byte offset
    where the whole lines end; `lines[i]` is the line rows[i] was read from. Bad content raises nothing (read_rows
    raises, the gate lists it); an unreadable file is a ConfigError.
    """
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}); fix its permissions") from None
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    lines: list[int] = []
    torn, end = None, 0
    for n, line in enumerate(data.splitlines(keepends=True), start=1):
        if not line.endswith(b"\n"):
            torn = n
            break
        end += len(line)
        try:
            row = loads(line)
        except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
            why = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8 text"
            problems.append(f"{path}:{n}: line {n} is not valid JSON ({why}); {CORRUPT}")
            continue
        if not isinstance(row, dict) or not row:
            what = "an empty object" if row == {} else f"{_json_kind(row)}, not an object"
            need = ", ".join(required)
            problems.append(f"{path}:{n}: line {n} is {what}: a row is a JSON object with {need}; {CORRUPT}")
            continue
        if not _unicode(row):
            problems.append(
                f"{path}:{n}: line {n} holds an escape that is no Unicode character (a lone surrogate such as "
                f"\\ud800); {CORRUPT}"
            )
            continue
        missing = [k for k in required if row.get(k) is None]
        if missing:
            need = ", ".join(required)
            problems.append(f"{path}:{n}: line {n} has no {', '.join(missing)} (every row needs {need}); {CORRUPT}")
            continue
        wrong = next(
            (f"has {k}={row[k]!r}, not a string" for k in KEYS if k in required and not isinstance(row[k], (str, int))),
            None,
        ) or (check(row) if check else None)
        if wrong:
            problems.append(f"{path}:{n}: line {n} {wrong}; {CORRUPT}")
            continue
        rows.append(row)
        lines.append(n)
    return rows, problems, torn, end, lines


def _unicode(row: dict) -> bool:
    """Whether every string of a row read back is Unicode text that can be written out again (JSON's \\ud800 escapes
    read as lone surrogates, which no file can hold as UTF-8)."""
    try:
        json.dumps(row, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _json_kind(value: Any) -> str:
    kinds = {type(None): "null", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def read_back(path: Path) -> tuple[list[Row], list[str], int | None, list[int]]:
    """What the gate and a resumed run read: every line of a samples.jsonl that is a row the gate can judge (the
    fields it reads, scores and bytes finite numbers in range: records.checks.row_problem) and a Row (row_error), as
    a Row; a problem naming file:line and the fix for every other whole line. Returns (rows, problems, torn,
    lines) as scan_rows does."""
    rows, problems, torn, _, lines = scan_rows(path, ROW_FIELDS, lambda r: row_problem(r) or row_error(r))
    return [Row.from_dict(r) for r in rows], problems, torn, lines


def torn_line(path: Path, n: int) -> str:
    return f"{path}:{n}: line {n} is torn (a write was killed); finish the run with resume=true"


def cut_torn(path: Path) -> None:
    """Before a run continues its samples.jsonl: a torn final line (a killed write) cut off; a whole line that is not a
    JSON object with sample_id and variant a ConfigError naming `file:line` (what the rest of each row must be is
    checked once the run knows its samples: evalkit.run.resume.check_written)."""
    if not path.exists():
        return
    _, problems, torn, end, _ = scan_rows(path)
    _refuse(problems)
    if torn is not None:
        with path.open("r+b") as f:
            f.truncate(end)


def read_rows(path: Path) -> list[Row]:
    """Rows of a samples.jsonl, each a Row; a torn final line (a killed write) is left out. A whole line that is not a
    JSON object that makes a Row (records.schema.row_error) is a ConfigError naming `file:line`."""
    if not path.exists():
        return []
    rows, problems, _, _, _ = scan_rows(path, check=row_error)
    _refuse(problems)
    return [Row.from_dict(r) for r in rows]


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ConfigError(problems[0] + (f" ({len(problems) - 1} more bad lines)" if len(problems) > 1 else ""))


def write_failed(path: Path, err: OSError) -> ConfigError:
    return ConfigError(
        f"could not write {path} ({err.strerror or err}); the rows already written are intact: free disk space "
        "or fix the folder's permissions, then add resume=true to continue"
    )


class RecordWriter:
    """Appends rows to samples.jsonl, a sample's rows in one write, flushed to disk before the next sample starts."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = path.open("ab")
        except OSError as err:
            raise write_failed(path, err) from None

    def write(self, *rows: Mapping[str, Any]) -> None:
        """Append `rows` (a sample's baseline and variants: Rows, which read as the mappings the file holds) in one
        write and one fsync: a process killed meanwhile (a sweep's worker that its launcher stops) leaves all of them
        or none, never a sample's baseline alone."""
        if not rows:
            return
        start = self._file.tell()
        try:
            lines = (to_json(dict(row)) + "\n" for row in rows)
            self._file.write("".join(lines).encode())
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:
            self._undo(start)
            raise write_failed(self.path, err) from None

    def _undo(self, start: int) -> None:
        """Cut what a failed write left after the last whole row (a torn line is also cut when the run resumes)."""
        self.close()
        try:
            os.truncate(self.path, start)
        except OSError:
            pass

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:
                pass  # the buffered bytes could not be flushed: nothing more reached the file


def write_atomic(path: Path, text: str) -> None:
    """Write a file atomically: a crash leaves either the old file or the new one, never half of either, and of two
    processes writing it at once one whole file stays (each writes its own temporary file). An OSError is raised as
    it came, with no temporary file left behind."""
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


NOT_FINITE = "_not_finite"  # beside a key whose number was not finite: which it was ("nan", "inf", "-inf")


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float as null: in a mapping, with `<key>_not_finite` beside it saying which ("nan",
    "inf", "-inf"), so that a reader can tell "not computed" from a number; tuples become lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            out[key] = finite(value)
            if isinstance(value, float) and not math.isfinite(value):
                out[f"{key}{NOT_FINITE}"] = str(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def to_json(obj: Any, indent: int | None = None, default: Callable[[Any], Any] | None = None) -> str:
    """Strict JSON, what every file evalkit writes for machines holds: no NaN or Infinity (finite), which JSON.parse
    and strict parsers refuse; keys sorted, so that the same content is the same bytes."""
    return json.dumps(finite(obj), indent=indent, sort_keys=True, allow_nan=False, default=default)


def write_json(path: Path, obj: Any) -> None:
    """Write strict JSON (to_json) atomically (write_atomic); a failure is a ConfigError that names the file and the
    fix."""
    try:
        write_atomic(path, to_json(obj, indent=2) + "\n")
    except OSError as err:
        raise write_failed(path, err) from None


def config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


# The gate and the logger read the records, they do not change them, and results_root is where the folder lies,
# not what it measured: a resumed run may differ in them (a copied or moved folder resumes).
NOT_IDENTITY = ("resume", "gate", "logger", "results_root")


def experiment_config(config: dict) -> dict:
    """A run's config less what does not change what it measures (NOT_IDENTITY) and how many samples its task draws
    (SAMPLE_COUNT: samples are generated the same whatever the count, and their digests prove it, so resume=true
    with a larger count extends a run): two runs with equal ones are the same experiment."""
    out = {k: v for k, v in config.items() if k not in NOT_IDENTITY}
    if out.get("backend") == {"name": "hf"}:  # runs written before backends existed ran on hf
        del out["backend"]
    if isinstance(out.get("task"), dict):
        out["task"] = {k: v for k, v in out["task"].items() if k not in SAMPLE_COUNT}
    return out


def sample_identity(info: dict) -> str:
    """What makes a run's sample ids mean the same samples: the task's config less its sample count, the seed and the
    digests of the input files (12 hex digits of their sha256)."""
    config = info.get("config") or {}
    task = {k: v for k, v in (config.get("task") or {}).items() if k not in SAMPLE_COUNT}
    files = sorted(((info.get("data") or {}).get("files") or {}).values())
    text = json.dumps({"task": task, "seed": config.get("seed"), "files": files}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def sample_key(identity: str, info: dict, sample_id: str) -> str:
    """One sample across folders: its id and its content digest where run.json holds one (evalkit.run records every
    sample's: everything the sample feeds the model and is scored against), so that the same sample drawn again
    under another seed or config (a dataset that no seed changes) is one sample, never two; else the run's sample
    identity and the sample's id."""
    samples = (info.get("data") or {}).get("samples") if isinstance(info.get("data"), dict) else None
    digest = samples.get(str(sample_id)) if isinstance(samples, dict) else None
    return f"sample:{digest}:{sample_id}" if digest else f"{identity}::{sample_id}"
