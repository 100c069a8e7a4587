"""The record schema: what an engine is asked (`Job`) and answers (`Result`), a row of samples.jsonl (`Row`),
run.json (`RunInfo`), and how a variant's row is paired with the baseline's on the same sample (`pair`, `flip`).

Every engine (evalkit's own, llama.cpp, OpenAI-compatible servers, lm-eval's driver) answers in Results; the run's
sample loop and lm-eval's command line turn them into Rows here, and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError

BASELINE = "baseline"  # the full cache's variant label
FLIPS = (None, "lost", "gained")


def flip(score: float, base_score: float) -> str | None:
    """`lost` when the variant scores below the baseline on the sample, `gained` above, None when equal."""
    return None if score == base_score else ("lost" if score < base_score else "gained")


def flip_cause(row: dict, evicted_below: float = 0.5) -> str | None:
    """For a lost sample of a retrieval task: `evicted` when the evidence is held in fewer than half the layers'
    worth of its tokens (mean retention below `evicted_below`), else `ignored` (kept, yet the answer is wrong)."""
    retained = row.get("evidence_retained_per_layer")
    if row.get("flip") != "lost" or not retained:
        return None
    return "evicted" if sum(retained) / len(retained) < evicted_below else "ignored"


@dataclass
class Job:
    """One sample an engine answers: what its rows carry (`row`: sample_id, cell, and the question, answers and
    context every row of the sample records), the variants whose rows are missing (the baseline always runs: every
    variant is paired with it), and what an engine runs: the task's sample and its prompt (evalkit.tasks), the
    prompt's ids and its text (what a server is sent), the most tokens to generate."""

    sample_id: str
    row: dict[str, Any]
    variants: list[str] = field(default_factory=list)
    sample: Any = None
    prompt: Any = None
    ids: list[int] = field(default_factory=list)
    text: str = ""
    max_new_tokens: int = 0


@dataclass
class Result:
    """What an engine did on one sample for the baseline or one variant: the answer's text (None where the engine
    logged scores, not text), the row fields it observed (KV bytes, seconds, fidelity; `not_observed` names, with the
    reason, each field it cannot see), and its score where the engine scores (logits, lm-eval's metric); None: the
    task scores the prediction."""

    variant: str
    prediction: str | None
    fields: dict[str, Any] = field(default_factory=dict)
    score: float | None = None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


NAMED = ("run_id", "task", "protocol", "sample_id", "cell", "variant", "score", "baseline_score", "flip")


@dataclass(frozen=True, eq=False)
class Row(Mapping[str, Any]):
    """One variant on one sample, as samples.jsonl holds it: what names it (run, task, sample, variant), its score
    paired with the baseline's on the same sample, and `fields`, what the sample and the engine recorded beside.

    Every reader of samples.jsonl gets Rows (evalkit.records.read_rows, the gate's reading): the named fields as
    typed attributes, validated here; and, as a read-only mapping, the row as the file holds it, `row["kl_mean"]`,
    `row.get("policy")`, the named fields included (two rows are equal when their contents are)."""

    run_id: str
    task: str
    protocol: str | None
    sample_id: str | int
    cell: dict[str, Any]
    variant: str
    score: float
    baseline_score: float
    flip: str | None
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        wrong = bad_named(self)
        if wrong:
            raise ValueError(f"a row of {self.variant!r} on sample {self.sample_id!r} has a bad {', '.join(wrong)}")

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Row:
        """A row as read back (a JSON object of samples.jsonl): its named fields typed and validated (a ValueError
        that names them; a missing one is a KeyError), the rest kept as `fields`."""
        return cls(**{k: row[k] for k in NAMED}, fields={k: v for k, v in row.items() if k not in NAMED})

    def to_dict(self) -> dict[str, Any]:
        """The row as samples.jsonl holds it (its fields beside the named ones)."""
        return {**self.fields, **{name: getattr(self, name) for name in NAMED}}

    def replace(self, **named: Any) -> Row:
        """This row with other values for named fields (a merged table's labels and sample ids)."""
        return dataclasses.replace(self, **named)

    def __getitem__(self, key: str) -> Any:
        if key in NAMED:
            return getattr(self, key)
        return self.fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter([*self.fields, *(k for k in NAMED if k not in self.fields)])

    def __len__(self) -> int:
        return len(set(self.fields) | set(NAMED))


def bad_named(row: Mapping[str, Any]) -> list[str]:
    """The named fields of a row (a Row, or a JSON object holding them all) that are not of their kind."""
    sid = row["sample_id"]
    return [
        name
        for name, ok in (
            ("run_id", isinstance(row["run_id"], str)),
            ("task", isinstance(row["task"], str)),
            ("protocol", row["protocol"] is None or isinstance(row["protocol"], str)),
            ("sample_id", isinstance(sid, (str, int)) and not isinstance(sid, bool)),
            ("cell", isinstance(row["cell"], dict)),
            ("variant", isinstance(row["variant"], str) and bool(row["variant"])),
            ("score", is_number(row["score"])),
            ("baseline_score", is_number(row["baseline_score"])),
            ("flip", row["flip"] in FLIPS),
        )
        if not ok
    ]


def row_error(row: Mapping[str, Any]) -> str | None:
    """Why a JSON object read back is not a Row (a check for evalkit.records.scan_rows), or None."""
    missing = [k for k in NAMED if k not in row]
    if missing:
        return f"has no {', '.join(missing)} (every row evalkit writes has them)"
    wrong = bad_named(row)
    if wrong:
        return f"has a bad {', '.join(wrong)}: " + ", ".join(f"{k}={row[k]!r}" for k in wrong)
    return None


def pair(head: dict[str, Any], sample: dict[str, Any], results: list[Result], flips: bool = True) -> list[Row]:
    """The rows of one sample from an engine's Results, the baseline's first: `head` names the run (run_id, task,
    protocol), `sample` the sample (sample_id, cell, and what every row of it carries: question, answers, context).
    Each row is paired with the baseline: its score, the flip they make (None where `flips` is False: a
    teacher-forced continuation is scored against the baseline's logits, not its answer) and the baseline's bytes."""
    base = results[0]
    unscored = [r.variant for r in results if not is_number(r.score)]
    if unscored:
        raise ValueError(f"{unscored} have a bad score: every result is scored before it is paired (Result.score)")
    pairing = {}
    if "kv_bytes" in base.fields:  # the full cache's bytes on the same context, carried by every row of the sample
        pairing = {
            "kv_bytes_baseline": base.fields["kv_bytes"],
            "kv_bytes_baseline_deployed": base.fields.get("kv_bytes_deployed"),
            "decode_peak_kv_bytes_baseline_deployed": base.fields.get("decode_peak_kv_bytes_deployed"),
        }
    rest = {k: v for k, v in sample.items() if k not in ("sample_id", "cell")}
    rows = []
    for res in results:
        answer = {"prediction": res.prediction} if res.prediction is not None else {}
        rows.append(
            Row(
                run_id=head["run_id"],
                task=head["task"],
                protocol=head["protocol"],
                sample_id=sample["sample_id"],
                cell=sample["cell"],
                variant=res.variant,
                score=res.score,
                baseline_score=base.score,
                flip=flip(res.score, base.score) if flips else None,
                fields={**rest, **answer, **res.fields, **pairing},
            )
        )
    return rows


@dataclass
class RunInfo:
    """run.json: the run's identity (config, library versions, input files and sample digests) and what ran it (the
    model, the engine, the policies' preparation). Keys evalkit no longer writes are kept as read (`other`)."""

    run_id: str
    config: dict[str, Any]
    versions: dict[str, Any] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    started: str = ""
    protocol: str | None = None
    seed: int | None = None
    data: dict[str, Any] | None = None
    torch_threads: int | None = None
    model: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    prepared: dict[str, Any] | None = None
    resumed: list[str] | None = None
    route: str | None = None
    other: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """run.json's content: the fields that are set (an absent one is no key, as before it existed)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "other"}
        return {**self.other, **{k: v for k, v in out.items() if v is not None}}

    @classmethod
    def from_dict(cls, info: dict[str, Any]) -> RunInfo:
        names = {f.name for f in dataclasses.fields(cls)} - {"other"}
        other = {k: v for k, v in info.items() if k not in names}
        return cls(**{k: v for k, v in info.items() if k in names}, other=other)

    @classmethod
    def read(cls, path: Path) -> RunInfo:
        """run.json of a run being resumed; a ConfigError when it cannot be read or is not evalkit's."""
        try:
            info = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(
                f"{path} cannot be read ({err}); the run cannot be resumed: move the folder away to start afresh"
            ) from None
        if not isinstance(info, dict) or not isinstance(info.get("config"), dict) or "run_id" not in info:
            raise ConfigError(f"{path} is not an evalkit run.json; move the folder away to start afresh")
        return cls.from_dict(info)

    def update(self, fields: dict[str, Any]) -> None:
        """Record what an engine says of itself once open (`model`, `engine`, `prepared`)."""
        names = {f.name for f in dataclasses.fields(self)} - {"other"}
        for key, value in fields.items():
            if key in names:
                setattr(self, key, value)
            else:
                self.other[key] = value

    def head(self, task: str, protocol: str | None = None) -> dict[str, Any]:
        """What every row of this run names: the run, the task, the protocol (the run's unless an engine says its
        own)."""
        return {"run_id": self.run_id, "task": task, "protocol": protocol or self.protocol}
