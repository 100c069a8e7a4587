"""Variant labels across runs: runs merged into one table (a run's own summary, and chunked variants beside their
one-shot twins, are evalkit.records.summary)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from evalkit.records import BASELINE, Row, sample_identity, sample_key


class Group(NamedTuple):
    """What a variant is compared within: the task, the model and the engine of its run. Each has its own baseline:
    variants of different groups never share a Pareto front or an accuracy floor."""

    task: str
    model: str
    backend: str

    def title(self) -> str:
        return f"{self.task} · {self.model} · {self.backend}"


class Label(str):
    """A variant's label in merged rows: the text every table keys on and shows, built from parts that it carries as
    fields, so that nothing parses it again: `name`, the variant as its run recorded it (an opaque string: `/`, `@`,
    `+`, `:`, `=` and spaces are its own); `prefix`, the `task/` or `model/` that tells runs of several tasks or
    models apart ('' when they do not differ); `folder`, the run folder appended to rows that are not one
    measurement (''); `group`, the (task, model, backend) it is compared within."""

    name: str
    prefix: str
    folder: str
    group: Group | None

    def __new__(cls, name: str, prefix: str = "", folder: str = "", group: Group | None = None) -> Label:
        text = f"{prefix}/{name}" if prefix else name
        self = super().__new__(cls, f"{text} [{folder}]" if folder else text)
        self.name, self.prefix, self.folder, self.group = name, prefix, folder, group
        return self

    def __getnewargs__(self) -> tuple:  # pickled and copied with its parts (a sweep's jobs, deepcopy)
        return self.name, self.prefix, self.folder, self.group


def variant_name(label: str) -> str:
    """The variant as its run recorded it: a merged label's `name`, or the label itself (rows of one run)."""
    return label.name if isinstance(label, Label) else label


def group_of(label: str) -> Group | None:
    """The (task, model, backend) a merged label is compared within; None for a label that does not carry one."""
    return label.group if isinstance(label, Label) else None


def is_baseline(label: str) -> bool:
    """True for the full cache's variant: `baseline`, and a merged label whose run recorded it as `baseline`
    (`smollm2-135m/baseline`, `baseline [job]`), never a variant whose own name merely contains it."""
    return variant_name(label) == BASELINE


def label_order(label: str) -> tuple:
    """Sort key: per model/task prefix, the baseline first, then the variants by name."""
    prefix = label.prefix if isinstance(label, Label) else ""
    return prefix, not is_baseline(label), variant_name(label), str(label)


def label_fields(label: str) -> dict[str, Any]:
    """A merged label's parts as the fields of its entry in a machine-readable file (verdict.json): the variant as
    recorded and the run's task, model and backend; none for the label of a single run's rows."""
    if not isinstance(label, Label) or label.group is None:
        return {}
    return {"variant": label.name, "run": label.group._asdict()}


def merge(runs: list[tuple[Path, dict, list[Row]]]) -> list[Row]:
    """One table from the rows of several runs (folder, run.json, rows), e.g. the jobs of a Hydra multirun.

    Samples are identified across runs by their sample key (evalkit.records.sample_key: the sample's content digest
    and id where run.json records the digest, else the run's task config less its sample count, seed and input
    files, and the id), never by the id alone: two runs whose ids collide (needle at two seeds, two datasets numbered
    from 0) give two samples each, the same sample drawn at two seeds one, and a merged id that would collide gets
    the key's digest, `L256-d0.25-0#3f2a9c01`. Each row's variant becomes a Label that carries the variant as
    recorded, and its run's (task, model, backend), as fields. Variants are labelled so that rows that are not the
    same measurement never mix: when the runs differ in model or task, labels get a `model/` or `task/` prefix; a
    label measured with different settings (policy options, storage, prefill, protocol, engine) in different runs,
    or whose runs disagree on the same sample, gets its run folder appended, `h2o@0.5 [policy.recent=0.2]`. The same
    measurement in several runs (the baseline that every job of a sweep repeats) is kept once per sample. Nothing
    depends on the order of the runs.
    """
    if len(runs) == 1:
        _, info, rows = runs[0]
        return [r.replace(variant=Label(r.variant, group=_group(info, r))) for r in rows]
    models = {_model(info) for _, info, _ in runs}
    tasks = {r.task for _, _, rows in runs for r in rows}
    common = Path(os.path.commonpath([folder for folder, _, _ in runs]))
    labelled = []  # (label, settings, sample key, row, folder)
    for folder, info, rows in sorted(runs, key=lambda run: str(run[0])):
        prefix = "/".join(
            [
                *([str(rows[0].task)] if len(tasks) > 1 and rows else []),
                *([_model(info)] if len(models) > 1 else []),
            ]
        )
        identity, where = sample_identity(info), str(folder.relative_to(common)) if folder != common else folder.name
        for r in rows:
            g = _group(info, r)
            measured = [r.get(k) for k in ("policy", "quant", "prefill", "protocol")] + [g.backend]
            settings = json.dumps(measured, sort_keys=True)
            label = Label(r.variant, prefix, group=g)
            labelled.append((label, settings, sample_key(identity, info, r.sample_id), r, where))
    split = _split_labels(labelled)
    keys_of_id: dict[str, set[str]] = defaultdict(set)
    for _, _, key, r, _ in labelled:
        keys_of_id[str(r.sample_id)].add(key)
    out, seen = [], set()
    for label, _, key, r, folder in labelled:
        label = Label(label.name, label.prefix, folder, label.group) if label in split else label
        if (label, key) in seen:
            continue
        seen.add((label, key))
        sid = r.sample_id
        if len(keys_of_id[str(sid)]) > 1:
            sid = f"{sid}#{hashlib.sha256(key.encode()).hexdigest()[:8]}"
        out.append(r.replace(variant=label, sample_id=sid))
    return out


def _model(info: dict) -> str:
    """The model a run's run.json names (its `model` entry, else its config's)."""
    return _name(info.get("model")) or str(_name((info.get("config") or {}).get("model")))


def _group(info: dict, row: Row) -> Group:
    """The (task, model, backend) a row of the run `info` is compared within."""
    config = info.get("config") or {}
    task, backend = (v.get("name") if isinstance(v, dict) else v for v in map(config.get, ("task", "backend")))
    # rows name the engine where one other than evalkit's own (hf) ran them
    return Group(str(row.task or task), _model(info), str(row.get("backend") or backend or "hf"))


def answer(row: Row) -> str:
    """What a row answered, as one string: its score and prediction (two runs' rows of one sample are one measurement
    when these agree)."""
    return json.dumps([row.score, row.get("prediction")], default=str)


def _name(node: Any) -> str | None:
    return node.get("name") if isinstance(node, dict) else None


def _split_labels(labelled: list[tuple[Label, str, str, Row, str]]) -> set[str]:
    """Labels whose rows are not one measurement: recorded with different settings in different runs, or with
    different answers for the same sample in different runs."""
    settings: dict[str, set[str]] = defaultdict(set)
    answers: dict[tuple[str, str], set[str]] = defaultdict(set)
    for label, setting, key, r, _ in labelled:
        settings[label].add(setting)
        answers[label, key].add(answer(r))
    return {label for label, s in settings.items() if len(s) > 1} | {
        label for (label, _), a in answers.items() if len(a) > 1
    }
