"""Which verdict.json speaks for the rows in some run folders: the one check that the report and the planner make
before they show a verdict (neither judges: each judgement is a look, recorded by the gate).

A verdict.json is the gate's for these rows when it names these runs, its digest (evalkit.records.looks.digest) is that
of the rows the folders hold now at its thresholds, and its verdict and reasons are those of the last look of that
digest every folder's looks.jsonl records, the looks numbered 1, 2, 3 (evalkit.records.looks.read refuses anything
else). Of that digest: a sweep's job folder records its own look, then the look that judged it beside the others. A
verdict.json edited after the gate wrote it (a PASS written over an INCONCLUSIVE, its reasons emptied) disagrees with
its look; anything else is "no verdict for these rows", with why in one line. A CANNOT JUDGE (no look: nothing was
judged) is shown where it judged these rows: it claims nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.records import loads, looks
from evalkit.records.reading import Records, run_folders
from evalkit.records.verdict import VERDICT
from evalkit.thresholds import thresholds

NO_VERDICT = "NO VERDICT"  # no verdict.json of the gate speaks for these rows
CANNOT_JUDGE = "CANNOT JUDGE"


def shown_verdict(
    run_dirs: list[Path], records: Records, path: Path | None = None
) -> tuple[dict[str, Any] | None, str]:
    """(run_dirs[0]'s verdict.json, or the one at `path` (the gate's --out), '') where the gate wrote it for exactly
    these runs and rows, else (None, why not, in one line)."""
    path = path or run_dirs[0] / VERDICT
    try:
        doc = loads(path.read_text())
    except FileNotFoundError:
        return None, f"no {path}"
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return None, f"{path} cannot be read ({getattr(err, 'strerror', None) or err})"
    if not isinstance(doc, dict):
        return None, f"{path} is not a JSON object"
    why = _stale(doc, path, run_dirs, records) or _unrecorded(doc, path, run_dirs, records)
    return (None, why) if why else (doc, "")


def _stale(doc: dict, path: Path, run_dirs: list[Path], records: Records) -> str:
    """Why a verdict.json does not speak for these runs and rows now ('' when it does)."""
    judged = [Path(str(r)) for r in doc.get("runs") or []] if isinstance(doc.get("runs"), list) else []
    if judged and not _same_runs(judged, run_dirs):
        return f"{path} judged other runs"
    if not judged and len(run_dirs) > 1:
        return f"{path} does not say which runs it judged"
    if not isinstance(doc.get("thresholds"), dict) or not isinstance(doc.get("digest"), str):
        return f"{path} does not say which rows it judged (no digest)"
    try:
        t = thresholds(doc["thresholds"], f"in {path}")
    except ConfigError as err:
        return f"{path}: its thresholds cannot be read ({err})"
    if looks.digest(records.rows, t) != doc["digest"]:
        return f"{path} judged other rows than the folder holds now (its digest does not match)"
    return ""


def _unrecorded(doc: dict, path: Path, run_dirs: list[Path], records: Records) -> str:
    """Why the looks the folders record do not vouch for `doc` ('' when every folder's last look has its verdict,
    reasons and digest). CANNOT JUDGE needs none: the gate records no look where it judged nothing, and it claims
    nothing of the rows (the report shows it with the gate's reasons)."""
    if doc.get("verdict") == CANNOT_JUDGE:
        return ""
    try:
        folders = run_folders(run_dirs)
    except ConfigError as err:
        return str(err)
    for folder in folders:
        recorded = looks.read([folder], records.infos)
        if recorded.problems:
            return recorded.problems[0]
        # the last look of these rows at these thresholds (a later look may have judged them beside other runs)
        mine = [(at, r) for at, r in recorded.looks if r["digest"] == doc["digest"]]
        if not mine:
            return f"{folder / looks.LOOKS_FILE} records no look of these rows: the gate records one with each verdict"
        at, record = mine[-1]
        if {k: record.get(k) for k in ("verdict", "reasons")} != {k: doc.get(k) for k in ("verdict", "reasons")}:
            return (
                f"{path} is not what the gate decided at its last look of these rows ({at}: {record.get('verdict')}): "
                "verdict.json was edited, or written by another judgement"
            )
    return ""


def _same_runs(judged: list[Path], run_dirs: list[Path]) -> bool:
    """The folders a verdict names are these runs: the same paths, or, for a path the gate was given relative to
    another working directory, the same trailing folders."""
    runs = [d.resolve() for d in run_dirs]

    def names(p: Path, r: Path) -> bool:
        return p.resolve() == r or (not p.is_absolute() and r.parts[-len(p.parts) :] == p.parts)

    matched = {next((r for r in runs if names(p, r)), None) for p in judged}
    return len(judged) == len(runs) and matched == set(runs)
