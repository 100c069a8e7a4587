"""Reading run folders for the gate: every row and run.json, what cannot be judged file by file (torn, corrupt,
repeated or contradicting rows, several runs in one file, a variant not on the baseline's samples), and the rows of
several runs merged into one table (merge)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from evalkit import scoring
from evalkit.errors import ConfigError
from evalkit.records import RUN, SAMPLES, Row, experiment_config, loads, read_back, torn_line
from evalkit.records.checks import contradictions
from evalkit.records.evidence import judged_fields, run_problems, task_config, undocumented
from evalkit.records.merged import answer, is_baseline, merge


@dataclass
class Records:
    """The rows of one or more runs merged into one table (merge), and why they cannot be judged, if they cannot."""

    rows: list[Row]  # the rows that could be read, each (sample, variant) once
    infos: list[dict]  # the run.json of every run that has a readable one
    problems: list[str] = field(default_factory=list)  # each names the file (and line) and the fix
    partial: list[str] = field(default_factory=list)  # runs whose rows hold fewer samples than their run.json


LISTED = 3  # bad lines named per file; the rest are counted


def read_runs(run_dirs: list[Path]) -> Records:
    """All rows and run.json files under the given folders (a Hydra multirun folder holds several runs), the rows
    merged into one table with variant labels that keep different measurements apart (merge), and every
    reason, file by file, why they cannot be judged."""
    runs, infos, problems, partial = [], [], [], []
    for d in run_dirs:
        for run in run_folders([d]):
            info, problem = read_info(run / RUN)
            problem = problem or next(iter(run_problems(info, str(run / RUN))), None)
            if problem:
                problems.append(problem)
            else:
                infos.append({**info, "_folder": str(run.resolve())})  # in memory only: the folder the advice extends
            rows, lines, bad = read_records(run / SAMPLES)
            where = str(run / SAMPLES)
            problems += (
                bad
                or check_rows(rows, where, info.get("run_id"))
                or contradictions(rows, lines, where) + judged_fields(rows, lines, where, info)
                or undocumented(rows, where)
                or ([] if problem else _samples(rows, info, str(run / RUN), partial))
            )
            # a run.json that cannot be used (its problem is listed) names nothing: its rows merge as an unnamed run's
            runs.append((run.resolve(), {} if problem else info, _once(rows)))
    return Records(merge(runs), infos, problems + _same_experiment(runs), partial)


def run_folders(run_dirs: list[Path]) -> list[Path]:
    """Every run folder under the given ones (a Hydra multirun folder holds several), or a ConfigError naming a
    folder that holds none."""
    out = []
    for d in run_dirs:
        found = [d] if (d / SAMPLES).exists() else sorted(p.parent for p in d.rglob(SAMPLES))
        if not found:
            raise ConfigError(f"{d}: no {SAMPLES} found; give an evalkit run folder (results/...)")
        out += found
    return out


def read_info(path: Path) -> tuple[dict, str | None]:
    """A run's run.json, or ({}, why it cannot be used)."""
    fix = (
        "the gate needs the run.json its run wrote beside the rows (config, model, versions): judge the folder the "
        "run wrote, or rerun it"
    )
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, f"{path}: missing; {fix}"
    except (OSError, UnicodeDecodeError) as err:
        return {}, f"{path}: cannot be read ({getattr(err, 'strerror', None) or err}); fix its permissions, or {fix}"
    if not text.strip():
        return {}, f"{path}: empty (a write was killed?); {fix}"
    try:
        info = loads(text)
    except json.JSONDecodeError as err:
        return {}, f"{path}: not valid JSON ({err.msg}, line {err.lineno}); {fix}"
    if not isinstance(info, dict):
        return {}, f"{path}: not a JSON object; {fix}"
    return info, None


def read_records(path: Path) -> tuple[list[Row], list[int], list[str]]:
    """The rows of a samples.jsonl that the gate can read, the line of each, and a problem for every line it cannot
    (torn included; a row whose scores or bytes are not finite numbers in range, or that is not a Row:
    evalkit.records.read_back)."""
    try:
        rows, bad, torn, lines = read_back(path)
    except ConfigError as err:
        return [], [], [str(err)]
    if len(bad) > LISTED:
        bad = [*bad[:LISTED], f"{path}: {_n(len(bad) - LISTED, 'more line')} like these"]
    return rows, lines, bad + ([torn_line(path, torn)] if torn is not None else [])


def _once(rows: list[Row]) -> list[Row]:
    """The first row of every (sample, variant)."""
    first: dict[tuple, Row] = {}
    for r in rows:
        first.setdefault((r.sample_id, r.variant), r)
    return list(first.values())


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


def _some(values, k: int = 3) -> str:
    values = sorted(map(str, values))
    return ", ".join(values[:k]) + (f" and {len(values) - k} more" if len(values) > k else "")


def check_rows(rows: list[Row], where: str, run_id: str | None = None) -> list[str]:
    """Why the rows of one records file (one run) cannot be judged: none, repeated (sample, variant) rows, rows of
    several runs or configurations, no baseline or no policy rows, a variant not run on the baseline's samples."""
    if not rows:
        return [f"{where}: no rows; the run wrote none: finish it with resume=true, or give a finished run's folder"]
    return _repeated(rows, where) + _several_runs(rows, where, run_id) + _coverage(rows, where)


def _repeated(rows: list[Row], where: str) -> list[str]:
    first: dict[tuple, int] = {}
    repeats = []
    for i, r in enumerate(rows, start=1):
        key = (r.sample_id, r.variant)
        if key in first:
            repeats.append((key, first[key], i))
        else:
            first[key] = i
    if not repeats:
        return []
    (sid, variant), a, b = repeats[0]
    verb = "repeats" if len(repeats) == 1 else "repeat"
    return [
        f"{where}: {_n(len(repeats), 'row')} {verb} a (sample, variant) already recorded (first: sample {sid!r}, "
        f"variant {variant!r}, lines {a} and {b}): rows were written twice (a run's rows appended to its own "
        "file?); keep one row per sample and variant, or rerun into a new folder"
    ]


def _several_runs(rows: list[Row], where: str, run_id: str | None) -> list[str]:
    ids = {r.run_id for r in rows}
    if len(ids) > 1:
        return [
            f"{where}: rows of {len(ids)} runs in one file (run ids {_some(ids)}): several runs wrote the same "
            "folder; give each run its own folder (hydra.run.dir=...) and rerun them"
        ]
    out = []
    if ids and run_id is not None and ids != {str(run_id)}:
        out.append(
            f"{where}: the rows were written by run {ids.pop()}, but the run.json beside them is run {run_id}'s: "
            "several runs wrote the same folder; give each run its own folder (hydra.run.dir=...) and rerun"
        )
    settings: dict[str, set[str]] = defaultdict(set)
    for r in rows:
        settings[r.variant].add(
            json.dumps([r.get(k) for k in ("task", "protocol", "policy", "quant", "prefill")], sort_keys=True)
        )
    mixed = sorted(v for v, s in settings.items() if len(s) > 1)
    if mixed:
        out.append(
            f"{where}: variants {_some(mixed)} recorded with different settings (task, protocol, policy, quant "
            "or prefill) in one file: rows of several configurations; give each run its own folder and rerun them"
        )
    return out


def _coverage(rows: list[Row], where: str) -> list[str]:
    samples: dict[str, set] = defaultdict(set)
    for r in rows:
        samples[r.variant].add(r.sample_id)
    base = set().union(*(ids for v, ids in samples.items() if is_baseline(v)))
    policies = sorted(v for v in samples if not is_baseline(v))
    if not policies:
        return [
            f"{where}: only baseline rows ({_n(len(base), 'sample')}), no policy rows: nothing to judge; run a policy "
            "(policy=... or variants=[...]), or finish the run with resume=true"
        ]
    if not base:
        return [
            f"{where}: no baseline rows: every variant must be compared with the full cache on the same samples; "
            "rerun with evalkit, which runs the baseline on every sample"
        ]
    out = []
    for v in policies:
        missing, extra = base - samples[v], samples[v] - base
        parts = (
            [f"lacks {len(missing)} of the baseline's {_n(len(base), 'sample')} ({_some(missing)})"] if missing else []
        )
        parts += [f"has {_n(len(extra), 'sample')} the baseline lacks ({_some(extra)})"] if extra else []
        if parts:
            out.append(
                f"{where}: variant {v!r} {' and '.join(parts)}: it was not run on the baseline's samples; finish "
                "the run with resume=true, or rerun it"
            )
    return out


def _samples(rows: list[Row], info: dict, where: str, partial: list[str]) -> list[str]:
    """The run's rows against the samples its run.json lists (data.samples): rows of a sample it never drew cannot
    be judged; samples without rows (a run killed, cells never run) make the run unfinished, said in `partial`.
    lm-eval's runs (task external) list no samples: lm-eval draws its documents."""
    if scoring.external(task_config(info)):
        return []
    listed = (info.get("data") or {}).get("samples")
    if not isinstance(listed, dict) or not listed:
        return [
            f"{where}: lacks data.samples, the samples the run drew: without it an unfinished run looks finished; "
            "judge the run.json its run wrote, or rerun it"
        ]
    have = {str(r.sample_id) for r in rows if is_baseline(r.variant)}
    extra, missing = have - set(listed), set(listed) - have
    if extra:
        return [
            f"{where}: the rows hold {_n(len(extra), 'sample')} this run never drew ({_some(extra)}): rows of another "
            "run were added; give each run its own folder, or rerun it"
        ]
    if missing:
        cells = {json.dumps(r.cell, sort_keys=True) for r in rows}
        partial.append(
            f"{where}: the run is unfinished: {len(have)} of the {len(listed)} samples it drew have rows "
            f"({len(missing)} missing, e.g. {_some(missing)}; {_n(len(cells), 'cell')} with rows): finish it with "
            "resume=true, or judge what it has with gate.allow_partial=true"
        )
    return []


def _same_experiment(runs: list[tuple[Path, dict, list[Row]]]) -> list[str]:
    """Folders of one experiment (the same config less its sample count, the same model) whose rows disagree on a
    sample: which of them counts would decide the verdict, so neither is judged. Folders that agree on every sample
    they share are one measurement (merge keeps each sample once)."""
    groups: dict[str, list[tuple[Path, dict]]] = defaultdict(list)
    for folder, info, rows in runs:
        if isinstance(info.get("config"), dict):
            key = json.dumps([experiment_config(info["config"]), (info.get("model") or {}).get("fingerprint")],
                             sort_keys=True, default=str)  # fmt: skip
            groups[key].append((folder, {(str(r.sample_id), r.variant): answer(r) for r in rows}))
    out = []
    for members in groups.values():
        for i, (a, rows_a) in enumerate(members):
            for b, rows_b in members[i + 1 :]:
                differ = sorted(k for k in set(rows_a) & set(rows_b) if rows_a[k] != rows_b[k])
                if differ:
                    sid, variant = differ[0]
                    out.append(
                        f"{a} and {b} are the same experiment (same config, seed and model) but disagree on "
                        f"{_n(len(differ), 'row')} (e.g. sample {sid!r}, {variant}): one measurement cannot have two "
                        "answers; judge one folder, or rerun into one"
                    )
    return out
