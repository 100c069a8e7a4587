"""Looks: every judgement of a run is recorded, one strict-JSON line appended to the run folder's looks.jsonl.

Every look, the first included, is judged by the anytime-valid betting test (evalkit.gate.checks), so the verdict
does not depend on the looks: they are an audit trail the report shows (how often these rows were judged, at which
counts).
The gate appends them under the run folder's lock (evalkit.lock), so gates run at once number their looks 1, 2, 3.
A judgement of the same rows at the same thresholds as the last recorded look is that look again, not a new one.

A record that does not match the rows it describes (malformed, numbered out of order, counting more contexts than
the rows hold, or claiming these very rows at other counts or thresholds) makes the records CANNOT JUDGE: the file
was edited. Older runs kept their looks in run.json["looks"]; those are read (checked the same way) for the number.

A record: {"look", "at", "digest", "verdict", "reasons", "thresholds", "runs", "variants": {name: {"contexts",
"questions", "cells": {cell: contexts}}}}. Its verdict and reasons are verdict.json's: the report and the planner show
a verdict.json only where they agree with the last look (evalkit.records.shown). Each folder numbers its own looks
1, 2, 3, with no gap or repeat.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from evalkit.records import Row, loads, to_json

LOOKS_FILE = "looks.jsonl"
LEGACY = "looks"  # the list an older run.json held
VERDICTS = ("PASS", "FAIL", "INCONCLUSIVE")
FIX = "the file was edited; restore it as the gate wrote it (its looks are an append-only record)"


@dataclass
class Recorded:
    """The looks recorded in the run folders being judged: (where, record) pairs, and lines that are not records."""

    looks: list[tuple[str, dict]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    last: list[tuple[str, dict] | None] = field(default_factory=list)  # each folder's last look (None: it has none)


@dataclass
class History:
    """This judgement's place among the recorded looks."""

    number: int = 1  # this judgement's look number (1: the first)
    repeat: bool = False  # the same rows and thresholds as every folder's last look: that look again


def digest(rows: list[Row], t) -> str:
    """What a look judged: its rows, every field, and the thresholds (judging the same rows again is the same look;
    verdict.json carries it, so a report shows a verdict only for the rows it judged)."""
    h = hashlib.sha256()
    for line in sorted(json.dumps(dict(r), sort_keys=True, default=str) for r in rows):
        h.update(line.encode())
        h.update(b"\n")
    h.update(json.dumps(asdict(t), sort_keys=True, default=str).encode())
    return "sha256:" + h.hexdigest()[:16]


def read(folders: list[Path], infos: list[dict]) -> Recorded:
    """The looks recorded in each folder: an older run.json's list first, then looks.jsonl line by line."""
    out = Recorded()
    by_folder = {str(i.get("_folder")): i for i in infos}
    for folder in folders:
        mine: list[tuple[str, dict]] = []
        legacy = by_folder.get(str(folder.resolve()), {}).get(LEGACY)
        if legacy is not None:
            where = f"{folder / 'run.json'}: looks"
            items = legacy if isinstance(legacy, list) else [legacy]
            _take(mine, out.problems, [(f"{where}[{i}]", x) for i, x in enumerate(items)])
        path = folder / LOOKS_FILE
        try:
            lines = path.read_text().splitlines() if path.exists() else []
        except (OSError, UnicodeDecodeError) as err:
            out.problems.append(f"{path}: cannot be read ({getattr(err, 'strerror', None) or err}); fix its mode")
            lines = []
        _take(mine, out.problems, [(f"{path}:{number}", _parse(line)) for number, line in enumerate(lines, 1)])
        out.looks += mine
        out.last.append(mine[-1] if mine else None)
    return out


def _parse(line: str) -> Any:
    try:
        return loads(line)
    except ValueError:
        return line


def _take(into: list[tuple[str, dict]], problems: list[str], records: list[tuple[str, Any]]) -> None:
    """Add each well-formed record (where it is, the record), in order, or name why it is not one."""
    for at, record in records:
        why = malformed(record)
        previous = into[-1][1]["look"] if into else 0
        if why is None and record["look"] != previous + 1:
            shown = str(record["look"]) if record["look"] < 10**12 else f"of {len(str(record['look']))} digits"
            why = f"look {shown} follows look {previous}: a run's looks are numbered 1, 2, 3, with no gap or repeat"
        if why:
            problems.append(f"{at}: look record {why}; {FIX}")
        else:
            into.append((at, record))


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def malformed(record: Any) -> str | None:
    """Why `record` is not a look record as the gate writes one (None when it is)."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    look = record.get("look")
    if not _count(look) or look < 1:
        return f'has look {json.dumps(look)}: a whole number from 1 is expected (e.g. "look": 1)'
    if not isinstance(record.get("digest"), str) or not record["digest"].startswith("sha256:"):
        return "has no digest of the rows it judged"
    if not isinstance(record.get("thresholds"), dict):
        return "has no thresholds"
    variants = record.get("variants")
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        return "has no variants"
    for name, v in variants.items():
        cells = v.get("cells", {})
        if not (_count(v.get("contexts")) and _count(v.get("questions")) and isinstance(cells, dict)):
            return f"counts of {name} are not whole numbers"
        if v["questions"] < v["contexts"] or not all(_count(n) for n in cells.values()):
            return f"counts of {name} are inconsistent (fewer questions than contexts, or a cell not counted)"
    return None


def history(recorded: Recorded, key: str) -> History:
    """This judgement's number: the last recorded look again when every folder's last look judged these rows at
    these thresholds (and recorded its reasons: a look an older gate wrote without them is taken again, so that the
    last look says what verdict.json says), else one more than the largest recorded."""
    if recorded.last and all(x is not None and x[1]["digest"] == key and "reasons" in x[1] for x in recorded.last):
        return History(max(x[1]["look"] for x in recorded.last if x is not None), True)
    return History(1 + max((r["look"] for _, r in recorded.looks), default=0))


def mismatches(recorded: Recorded, key: str, t, runs: list[str], now: dict[str, dict]) -> list[str]:
    """Recorded looks that do not match the rows now judged (`now`: this look's variants).

    `now` is evalkit.gate.decide.look_record's: a look of these runs cannot have counted more contexts or questions
    than the rows hold (rows are only added), and a look of these very rows (its digest) must have judged them at
    these thresholds and counts."""
    problems = []
    here = json.loads(json.dumps(asdict(t), default=str))
    for where, r in recorded.looks:
        same = r["digest"] == key
        if same and r["thresholds"] != here:
            problems.append(f"{where}: look {r['look']} judged these rows at other thresholds than its digest; {FIX}")
            continue
        if not same and r.get("runs") != runs:
            continue
        for name, v in r["variants"].items():
            n = now.get(name)
            if n is None:
                continue
            more = v["contexts"] > n["contexts"] or v["questions"] > n["questions"]
            if (same and (v["contexts"], v["questions"]) != (n["contexts"], n["questions"])) or more:
                problems.append(
                    f"{where}: look {r['look']} counts {v['contexts']} contexts and {v['questions']} questions of "
                    f"{name}, the rows hold {n['contexts']} and {n['questions']}; {FIX}"
                )
                break
    return problems


def entry(h: History, key: str, verdict: str, t, runs: list[str], variants: dict[str, dict]) -> dict[str, Any]:
    """The record of this look (`variants`: name -> contexts, questions, cells; `runs`: the run ids judged)."""
    return {
        "look": h.number,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "digest": key,
        "verdict": verdict,
        "thresholds": asdict(t),
        "runs": runs,
        "variants": variants,
    }


def append(folders: list[Path], look: dict[str, Any], h: History, recorded: Recorded | None = None) -> list[str]:
    """Append `look` to every folder's looks.jsonl (one line, flushed to disk; nothing when it repeats the last look).
    Each folder's line is numbered after that folder's own last look (`recorded`, read from `folders` in this order),
    so a folder's looks run 1, 2, 3 even when it is judged beside a folder judged more often. The caller holds the
    folders' locks. Returns a line for every folder where it could not be written."""
    if h.repeat:
        return []
    known = recorded is not None and len(recorded.last) == len(folders)
    problems = []
    for i, folder in enumerate(folders):
        before = recorded.last[i] if known else None
        number = (before[1]["look"] if before else 0) + 1 if known else look["look"]
        line = to_json({**look, "look": number}) + "\n"
        path = folder / LOOKS_FILE
        try:
            with open(path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            problems.append(
                f"{path}: look {h.number} not recorded ({err.strerror or err}): the verdict does not depend on it, "
                "but the run's audit trail misses it; make the folder writable"
            )
    return problems
