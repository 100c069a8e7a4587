"""Bring your own data: one JSON object a line, `{id, context, question, answers, meta?}`.

Every bad row is reported with the file, line number and field (bad JSON, a missing or empty field, answers
that are not a list of strings, a duplicate id), all at once and before any model loads. `meta` fields become
breakdown keys in the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from evalkit.errors import ConfigError
from evalkit.tasks import Sample, Task

MAX_REPORTED = 20


def read_jsonl(path: str | Path) -> list[Sample]:
    """Validated samples of a JSONL file; ConfigError naming every bad row (up to MAX_REPORTED) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task.path={str(path)!r} is not a file; give the path of a JSONL file")
    problems: list[str] = []
    samples: list[Sample] = []
    first_line: dict[str, int] = {}
    for n, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a BOM may open the file
        except UnicodeDecodeError as err:
            problems.append(f"{path}:{n}: not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})")
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"{path}:{n}: not valid JSON ({err.msg} at column {err.colno})")
            continue
        errors = _row_errors(row)
        problems += [f"{path}:{n}: {e}" for e in errors]
        if errors:
            continue
        sid = str(row["id"])
        if sid in first_line:
            problems.append(f"{path}:{n}: field 'id': {sid!r} repeats the id of line {first_line[sid]}")
            continue
        first_line[sid] = n
        meta = row.get("meta") or {}
        samples.append(Sample(sid, row["context"], row["question"], row["answers"], dict(meta)))
    if problems:
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise ConfigError(f"{len(problems)} bad row(s) in {path}:\n  " + "\n  ".join(problems[:MAX_REPORTED]) + more)
    if not samples:
        raise ConfigError(f"{path} holds no rows; each line should be {{id, context, question, answers, meta?}}")
    return samples


def _row_errors(row: Any) -> list[str]:
    if not isinstance(row, dict):
        return [f"a row must be a JSON object, got {type(row).__name__}"]
    errors = []
    for name in ("id", "context", "question"):
        value = row.get(name)
        if value is None:
            errors.append(f"field {name!r} is missing")
        elif not isinstance(value, (str, int)) or (name != "id" and not isinstance(value, str)):
            errors.append(f"field {name!r} must be a string, got {type(value).__name__}")
        elif str(value).strip() == "":
            errors.append(f"field {name!r} is empty")
    answers = row.get("answers")
    if answers is None:
        errors.append("field 'answers' is missing")
    elif not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        errors.append("field 'answers' must be a non-empty list of non-empty strings")
    meta = row.get("meta")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, (str, int, float, bool)) for v in meta.values())
    ):
        errors.append("field 'meta' must be an object of strings, numbers or booleans")
    return errors


@dataclass(kw_only=True)
class JsonlTask(Task):
    """Samples from the user's JSONL file, scored by answer containment (all references, RULER-style)."""

    name: str = "jsonl"
    path: str = ""
    rows: list[Sample] = field(default_factory=list, repr=False)

    def validate(self) -> None:
        super().validate()
        if not self.path:
            raise ConfigError("task=jsonl needs task.path=FILE (one {id, context, question, answers} object a line)")
        self.rows = read_jsonl(self.path)

    def lengths(self) -> list[int]:
        return []  # known only once tokenized; budgets are checked per sample

    def samples(self, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        return self.rows or read_jsonl(self.path)
