"""Any Hugging Face dataset as an evalkit task: `task=hf task.path=...`, and the long-context suites' presets
(task=ruler, longbench, infinitebench, loogle, zero_scrolls, needle_in_haystack).

`task.path` is a Hub id (with `task.config`, `task.data_dir`, `task.split`), a folder written by
`Dataset.save_to_disk`, a parquet / JSON / JSON-lines / CSV file, or a folder of such files; all go through the
`datasets` library. Nothing is downloaded offline (`HF_DATASETS_OFFLINE=1`, or no network): a Hub id with no copy in
the datasets cache is a one-line error naming the command that fetches it on a connected machine.

Columns follow kvpress's layout (`context`, `question`, `answer_prefix`, `answer`, `max_new_tokens`, `task`), or
are mapped (`task.columns.context=document`). Several rows on one context are answered from one prefill and one
compression of it (the query-agnostic setting; evalkit.engine.engine.run_sample's `shared`), each row scored on its own.
The `task` column (subtask) is the breakdown key `subtask` of reports and of the gate's cells.

Rows are validated as JSONL rows are (evalkit.tasks.jsonl), named by their index in the dataset and their column,
all at once, before any model loads. A context too long for the model is cut in the middle (LongBench's
truncation: the first and last halves of the token budget are kept) or refused (`task.truncate`); each row records
what was done in its `truncation` field."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from evalkit import scoring
from evalkit.errors import ConfigError
from evalkit.tasks import Sample, Task
from evalkit.tasks.hf_load import load
from evalkit.tasks.jsonl import MAX_REPORTED, _row_errors
from evalkit.tasks.needle_in_haystack import insert
from evalkit.tasks.prompt import build_prompt

# evalkit's fields and the dataset columns they come from by default (kvpress's layout).
COLUMNS = {
    "id": None,  # a unique id column; null: the row's index in the dataset
    "context": "context",
    "question": "question",
    "answers": "answer",  # a string or a list of strings
    "answer_prefix": "answer_prefix",
    "max_new_tokens": "max_new_tokens",
    "subtask": "task",
    "all_classes": "all_classes",  # LongBench's class names (trec)
    "needle": "needle",  # needle_in_haystack: the sentence inserted into the essay
}


REQUIRED = ("context", "question", "answers")


TRUNCATE = ("middle", "refuse")


def _answers(value: Any) -> Any:
    """A string or a list of strings (finite numbers read as text) -> list; anything else (NaN, a boolean, null) is
    left for validation, which refuses it."""

    def text(v: Any) -> bool:
        return isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))

    if text(value):
        return [str(value)]
    if isinstance(value, (list, tuple)) and value and all(text(v) for v in value):
        return [str(v) for v in value]
    return value


@dataclass
class DatasetRow:
    """A validated dataset row: its index, the sample it makes, and what scoring and decoding need of it."""

    index: int
    sample: Sample
    max_new_tokens: int | None
    extra: dict[str, Any]


@dataclass(kw_only=True)
class HfTask(Task):
    """Rows of a Hugging Face dataset, scored by `scorer` per subtask."""

    name: str = "hf"
    path: str = ""  # Hub id, save_to_disk folder, parquet/JSON/CSV file or a folder of them
    config: str | None = None  # the Hub dataset's configuration (load_dataset's name)
    data_dir: str | None = None  # a Hub dataset's sub-folder (kvpress: simonjegou/ruler data_dir=4096)
    split: str = "test"
    columns: dict[str, Any] = field(default_factory=lambda: dict(COLUMNS))
    scorer: str = "contains_all"  # contains_all, contains_any, ruler, longbench, infinitebench, loogle, ...
    limit: int | None = None  # at most this many rows, a seeded random subset (task.seed)
    fraction: float = 1.0  # this share of the rows, a seeded random subset
    truncate: str = "middle"  # middle: cut a context too long in its middle (LongBench); refuse: stop, naming rows
    context_window: int | None = None  # tokens a prompt and its answer must fit in; null: model.max_context
    needle_depths: list[float] = field(default_factory=list)  # needle_in_haystack: percent depths of the needle
    needle_context_length: int | None = None  # needle_in_haystack: context tokens the essay is cut to
    max_new_tokens: int = 32  # rows without a max_new_tokens column
    rows: list[DatasetRow] = field(default_factory=list, repr=False)
    _by_id: dict[str, DatasetRow] = field(default_factory=dict, init=False, repr=False)
    _truncation: dict[str, dict | None] = field(default_factory=dict, init=False, repr=False)

    def lengths(self) -> list[int]:
        return []  # known once tokenized: each sample is fitted to the window in samples()

    def validate(self) -> None:
        super().validate()
        if not self.path:
            raise ConfigError(
                "task=hf needs task.path: a Hub id (task.path=simonjegou/ruler task.data_dir=4096), a save_to_disk "
                "folder, or a parquet/JSON/CSV file"
            )
        if self.scorer not in scoring.SCORERS:
            raise ConfigError(f"task.scorer={self.scorer!r} is not one of {list(scoring.SCORERS)}")
        if self.truncate not in TRUNCATE:
            raise ConfigError(f"task.truncate={self.truncate!r} is not one of {list(TRUNCATE)}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"task.limit={self.limit}: give a number of rows >= 1, or null for all of them")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"task.fraction={self.fraction}: give a share of the rows in (0, 1]")
        if self.context_window is not None and self.context_window < 1:
            raise ConfigError(f"task.context_window={self.context_window}: give a number of tokens, or null")
        unknown = sorted(set(self.columns) - set(COLUMNS))
        if unknown:
            raise ConfigError(f"task.columns.{unknown[0]}: unknown field; the fields a column maps to: {list(COLUMNS)}")
        for key, column in self.columns.items():
            if column is not None and not isinstance(column, str):
                raise ConfigError(
                    f"task.columns.{key}={column!r}: name one column of the dataset, e.g. task.columns.{key}="
                    f"{COLUMNS[key] or 'id'}"
                )
            if column is None and key in REQUIRED:
                raise ConfigError(
                    f"task.columns.{key}=null: every sample needs its {key}; name the column that holds it, e.g. "
                    f"task.columns.{key}={COLUMNS[key]}"
                )
        if self.needle_depths and not self.needle_context_length:
            raise ConfigError("task.needle_depths needs task.needle_context_length (tokens of the haystack)")
        if any(not 0 <= d <= 100 for d in self.needle_depths):
            raise ConfigError(f"task.needle_depths={self.needle_depths}: give percents from 0 to 100")
        self.rows = self.read()

    # --- reading and validating -----------------------------------------------------------------------------------

    def read(self) -> list[DatasetRow]:
        ds = load(self.path, self.config, self.data_dir, self.split)
        mapping = {**COLUMNS, **self.columns}
        names = set(ds.column_names)
        if mapping["answers"] == "answer" and "answer" not in names and "answers" in names:
            mapping["answers"] = "answers"  # LongBench's column
        if self.needle_depths and mapping["answers"] not in names:
            mapping["answers"] = mapping["needle"]  # the needle is the answer
        missing = [
            f"{k} (column {c!r})"
            for k, c in mapping.items()
            if c is not None
            and c not in names
            and (k in REQUIRED or k in self.columns and self.columns[k] != COLUMNS[k])
        ]
        if missing:
            raise ConfigError(
                f"{self.path}: no column for {', '.join(missing)}; its columns: {sorted(names)}; map them with "
                "task.columns.FIELD=COLUMN, e.g. task.columns.context=document"
            )
        mapping = {k: (c if c in names else None) for k, c in mapping.items()}
        indices = self._subset(len(ds))
        table = ds.select(indices).to_list() if len(indices) < len(ds) else ds.to_list()
        rows, problems, first = [], [], {}
        module = scoring.module(self.scorer) if self.scorer not in ("contains_all", "contains_any") else None
        for index, raw in zip(indices, table, strict=True):
            row, errors = self._row(index, raw, mapping, module)
            problems += [f"row {index}: {e}" for e in errors]
            if row is None:
                continue
            if row.sample.id in first:
                column = mapping["id"]
                problems.append(
                    f"row {index}: column {column!r}: {row.sample.id!r} repeats the id of row {first[row.sample.id]}"
                )
                continue
            first[row.sample.id] = index
            rows.append(row)
        if problems:
            more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
            raise ConfigError(
                f"{len(problems)} bad row(s) in {self.path}:\n  " + "\n  ".join(problems[:MAX_REPORTED]) + more
            )
        if not rows:
            raise ConfigError(f"{self.path} ({self.split}) holds no rows")
        rows = self._expand_needles(rows)
        # the questions on one context next to each other, in order of first appearance: one prefill serves them
        order: dict[str, int] = {}
        rows.sort(key=lambda r: order.setdefault(r.sample.context, len(order)))
        self._by_id = {r.sample.id: r for r in rows}
        return rows

    def _subset(self, n: int) -> list[int]:
        """Row indices to run: all, or a random subset of `fraction` of them, at most `limit`, seeded by task.seed.
        The subsets are nested: the first k of one seeded order of all n rows, so that a larger limit or fraction
        with resume=true keeps every row already run and adds new ones (the gate's advice, `task.limit=N`)."""
        k = min(n, max(1, round(n * self.fraction)), self.limit or n)
        if k == n:
            return list(range(n))
        order = list(range(n))
        random.Random(self.seed).shuffle(order)
        return sorted(order[:k])

    def _row(self, index: int, raw: dict, mapping: dict, module) -> tuple[DatasetRow | None, list[str]]:
        get = {k: (raw.get(c) if c else None) for k, c in mapping.items()}
        sid = str(get["id"]) if mapping["id"] else str(index)
        subtask = get["subtask"]
        candidate = {
            "id": sid,
            "context": get["context"],
            # a blank question is allowed: a summary's rows ask nothing beyond their context (LooGLE, LongBench)
            "question": "-" if isinstance(get["question"], str) and not get["question"].strip() else get["question"],
            "answers": _answers(get["answers"]),
        }
        column = {"id": mapping["id"] or "id", "context": mapping["context"], "question": mapping["question"]}
        column["answers"] = mapping["answers"]
        errors = [
            re.sub(r"field '(\w+)'", lambda m: f"column {column.get(m.group(1), m.group(1))!r}", e)
            for e in _row_errors(candidate)
        ]
        if self.scorer == "zero_scrolls" and any("answer" in e for e in errors):
            errors.append("ZeroSCROLLS keeps its test answers private: score a split with answers")
        prefix = get["answer_prefix"]
        if prefix is not None and not isinstance(prefix, str):
            errors.append(f"column {mapping['answer_prefix']!r} must be a string, got {type(prefix).__name__}")
        budget = get["max_new_tokens"]
        if isinstance(budget, str):  # a CSV cell: every column is read as text
            budget = int(budget) if budget.strip().isdigit() else (None if not budget.strip() else budget)
        if subtask == "":
            subtask = None
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            errors.append(f"column {mapping['max_new_tokens']!r} must be a whole number >= 1, got {budget!r}")
        if subtask is not None and not isinstance(subtask, str):
            errors.append(f"column {mapping['subtask']!r} must be a string, got {type(subtask).__name__}")
        if module is not None:
            why = module.check(subtask or "")
            if why:
                errors.append(f"column {mapping['subtask'] or 'task'!r}: {why}")
        if errors:
            return None, errors
        cell = {"subtask": subtask} if subtask else {}
        extra = {"all_classes": get["all_classes"]} if get["all_classes"] else {}
        if get["needle"]:
            extra["needle"] = get["needle"]
        sample = Sample(
            sid, get["context"], get["question"] or "", candidate["answers"], cell, answer_prefix=prefix or ""
        )
        return DatasetRow(index, sample, budget, extra), []

    def _expand_needles(self, rows: list[DatasetRow]) -> list[DatasetRow]:
        """needle_in_haystack: each row once per depth (its context is built in samples(), with the tokenizer)."""
        if not self.needle_depths:
            return rows
        out = []
        for row in rows:
            for depth in self.needle_depths:
                cell = {**row.sample.cell, "depth": depth, "context_length": self.needle_context_length}
                sample = replace(row.sample, id=f"{row.sample.id}@{depth:g}", cell=cell)
                out.append(DatasetRow(row.index, sample, row.max_new_tokens, {**row.extra, "depth": depth}))
        return out

    # --- samples --------------------------------------------------------------------------------------------------

    def samples(self, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        rows = self.rows or self.read()
        if self.needle_depths:
            for row in rows:
                needle = row.extra.get("needle") or row.sample.answers[0]
                depth = row.extra["depth"]
                context, n = insert(tokenizer, row.sample.context, needle, self.needle_context_length, depth)
                # the cell says the length the essay gave: a short essay cannot fill the length asked
                row.sample = replace(row.sample, context=context, cell={**row.sample.cell, "context_length": n})
            self._by_id = {r.sample.id: r for r in rows}
        window = self.context_window or _tokenizer_window(tokenizer)
        self._check_answer_budgets(rows, window)
        out, refused = [], []
        groups: dict[str, list[DatasetRow]] = {}
        for row in rows:
            groups.setdefault(row.sample.context, []).append(row)
        for group in groups.values():
            fitted, record = self._fit(tokenizer, group, window)
            if fitted is None:
                refused.append(record)
                continue
            for sample in fitted:
                self._truncation[sample.id] = record
                out.append(sample)
        if refused:
            more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
            raise ConfigError(
                f"{len(refused)} context(s) of {self.path} do not fit the model's {window} tokens with their question "
                f"and answer: {', '.join(refused[:5])}{more}; task.truncate=middle cuts them in the middle as "
                "LongBench does (nothing was run)"
            )
        return out

    def _check_answer_budgets(self, rows: list[DatasetRow], window: int | None) -> None:
        """A row's own max_new_tokens cannot exceed the tokens the model takes at all: named by row and column."""
        big = [r for r in rows if window is not None and r.max_new_tokens and r.max_new_tokens >= window]
        if big:
            column = {**COLUMNS, **self.columns}["max_new_tokens"]
            r = big[0]
            raise ConfigError(
                f"row {r.index} of {self.path}: column {column!r} asks for {r.max_new_tokens} new tokens, more than "
                f"the {window} tokens the model takes with the prompt ({len(big)} row(s) like it); lower it in the "
                "data, or drop the column to use task.max_new_tokens"
            )

    def _fit(self, tokenizer, group: list[DatasetRow], window: int | None) -> tuple[list[Sample] | None, Any]:
        """The group's samples with their shared context cut in the middle to fit `window` (prompt + answer) for
        the longest of them, and the record of what was done (None: nothing); (None, rows) when refused."""

        samples = [r.sample for r in group]
        if window is None:
            return samples, None
        over = max(int(build_prompt(tokenizer, s).ids.shape[1]) + self.answer_tokens(s) - window for s in samples)
        if over <= 0:
            return samples, None
        ids = tokenizer(samples[0].context, add_special_tokens=False)["input_ids"]
        names = ", ".join(
            f"row {r.index} ({r.sample.id})" if str(r.index) != r.sample.id else f"row {r.index}" for r in group
        )
        if self.truncate == "refuse":
            return None, f"{names} ({over} tokens over)"
        keep = len(ids) - over
        for _ in range(8):  # decoding and re-encoding the halves may merge tokens at the cut: shrink until it fits
            if keep < 2:
                raise ConfigError(
                    f"{names} of {self.path}: the question, template and answer alone exceed {window} tokens; "
                    "give a longer task.context_window or fewer task.max_new_tokens"
                )
            head = keep // 2
            context = tokenizer.decode(ids[:head], skip_special_tokens=True) + tokenizer.decode(
                ids[len(ids) - (keep - head) :], skip_special_tokens=True
            )
            fitted = [replace(s, context=context) for s in samples]
            over = max(int(build_prompt(tokenizer, s).ids.shape[1]) + self.answer_tokens(s) - window for s in fitted)
            if over <= 0:
                record = {"mode": "middle", "context_tokens": len(ids), "kept_tokens": keep, "window": window}
                return fitted, record
            keep -= over
        raise ConfigError(f"{names}: the context could not be cut to fit {window} tokens")

    def input_files(self) -> list[str]:
        """The local files the rows come from (their sha256 is part of a run's identity): the file, or a folder's
        files; none for a Hub id (the samples' digests still guard a resumed run)."""
        local = Path(self.path).expanduser()
        if local.is_file():
            return [str(local.resolve())]
        if local.is_dir():
            return sorted(str(f.resolve()) for f in local.rglob("*") if f.is_file())
        return []

    # --- per row --------------------------------------------------------------------------------------------------

    def answer_tokens(self, sample: Sample) -> int:
        row = self._by_id.get(sample.id)
        return row.max_new_tokens if row is not None and row.max_new_tokens else self.max_new_tokens

    def row_fields(self, sample: Sample) -> dict[str, Any]:
        row = self._by_id.get(sample.id)
        return {
            "source": {"dataset": self.path, "split": self.split, "row": row.index if row else None},
            "truncation": self._truncation.get(sample.id),
        }

    def scorer_spec(self, sample: Sample) -> dict[str, Any]:
        """The dataset's scorer, with the row's subtask and what else it needs (the needle's depth is not scored)."""
        row = self._by_id.get(sample.id)
        extra = {k: v for k, v in (row.extra if row else {}).items() if k != "depth"}
        return scoring.spec(self.scorer, sample.cell.get("subtask") or "", extra)


def _tokenizer_window(tokenizer: PreTrainedTokenizerBase) -> int | None:
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n < 10**7 else None
