"""Looks: every judgement of a run is recorded in its run.json, and judging again after adding samples spends error
rate.

A run's first look was taken at a sample count fixed before any data, so the exact tests of evalkit.exact hold
there. Any later look was taken at a count that may follow from what the earlier looks showed (the gate's own
advice does exactly that), so it is judged by the anytime-valid betting test (evalkit.betting), with the error rate
the first look left (evalkit.checks.Spent). A judgement of the same rows at the same thresholds as the last recorded
look is that look again, not a new one.

run.json["looks"] is a list of {"look", "at", "digest", "verdict", "thresholds", "variants": {name: {"contexts",
"questions", "exact", "cells": {cell: contexts}}}}.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.records import RUN, write_json

LOOKS = "looks"


@dataclass
class History:
    """What earlier judgements of the runs being judged did."""

    number: int = 1  # this judgement's look number (1: the first)
    repeat: bool = False  # the same rows and thresholds as the last recorded look of every run: that look again
    first: list[dict[str, Any]] = field(default_factory=list)  # each run's first recorded look (when not this one)


def digest(rows: list[dict], t) -> str:
    """What a look judged: its rows' identities and the thresholds (judging the same rows again is the same look)."""
    keys = sorted(
        json.dumps([r.get("run_id"), r.get("sample_id"), r.get("variant"), r.get("context_id")], default=str)
        for r in rows
    )
    h = hashlib.sha256()
    for k in keys:
        h.update(k.encode())
    h.update(json.dumps(asdict(t), sort_keys=True, default=str).encode())
    return "sha256:" + h.hexdigest()[:16]


def history(infos: list[dict], key: str) -> History:
    """This judgement's place among the looks recorded in the runs' run.json files (`key`: its digest)."""
    recorded = [info.get(LOOKS) or [] for info in infos]
    recorded = [looks for looks in recorded if isinstance(looks, list) and looks]
    if not recorded:
        return History()
    last = [looks[-1] for looks in recorded]
    if len(recorded) == len(infos) and all(isinstance(x, dict) and x.get("digest") == key for x in last):
        number = max(int(x.get("look", 1)) for x in last)
        first = [] if number == 1 else [looks[0] for looks in recorded if isinstance(looks[0], dict)]
        return History(number, True, first)
    number = 1 + max(int(x.get("look", 1)) if isinstance(x, dict) else 1 for x in last)
    return History(number, False, [looks[0] for looks in recorded if isinstance(looks[0], dict)])


def entry(h: History, key: str, verdict: str, t, variants: dict[str, dict]) -> dict[str, Any]:
    """The record of this look, for run.json (`variants`: name -> contexts, questions, exact, cells)."""
    return {
        "look": h.number,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "digest": key,
        "verdict": verdict,
        "thresholds": asdict(t),
        "variants": variants,
    }


def record(folders: list[Path], look: dict[str, Any], h: History) -> list[str]:
    """Append `look` to every run's run.json (atomically; nothing when it repeats the last look). Returns a line for
    every run.json that could not be updated: its next look would then not know about this one."""
    if h.repeat:
        return []
    problems = []
    for folder in folders:
        path = folder / RUN
        try:
            info = json.loads(path.read_text())
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
            info[LOOKS] = [*(info.get(LOOKS) or []), look]
            write_json(path, info)
        except (OSError, ValueError, ConfigError) as err:
            problems.append(
                f"{path}: look {h.number} not recorded ({getattr(err, 'strerror', None) or err}): a later judgement "
                "of this run would not count it; make the file writable"
            )
    return problems
