"""What the report page shows, as plain data: the verdict, the runs, and where each row lies in its samples.jsonl.

The verdict is the gate's own: verdict.json when the gate judged exactly these runs after their last row was
written, otherwise the gate's judgement made now (gate.judge, the default thresholds or --gate), never a second
set of rules. Fields of verdict.json are read with defaults, so a verdict written by an older or newer gate still
renders (the look count, when it carries one, is shown).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalkit.errors import EXIT_FAIL, EXIT_OK, ConfigError
from evalkit.gate.judge import judge
from evalkit.gate.outputs import VERDICT, verdict_doc
from evalkit.gate.reading import Records
from evalkit.gate.summary import is_baseline
from evalkit.gate.thresholds import Thresholds
from evalkit.records import RUN, SAMPLES

VERSIONS = ("evalkit", "evalkit_git", "torch", "transformers", "lm_eval", "llama_cpp")
EXIT = {"PASS": EXIT_OK, "FAIL": EXIT_FAIL, "INCONCLUSIVE": 2, "CANNOT JUDGE": 2}


@dataclass
class VerdictView:
    """The top of the page: the gate's status, every reason, the thresholds, and what would settle it."""

    status: str
    reasons: list[str]
    thresholds: dict[str, Any]
    source: str  # where the verdict comes from, in words
    not_judged: list[str] = field(default_factory=list)
    advice: str | None = None
    extend: str | None = None  # INCONCLUSIVE: the command that adds the samples it needs
    looks: Any = None  # how many times these records were judged (sequential looks), when the verdict says
    cells: list[dict[str, Any]] = field(default_factory=list)
    variant_status: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int | None:
        return EXIT.get(self.status)


def run_folders(run_dirs: Iterable[Path]) -> list[Path]:
    """Every run folder under the given ones, as the gate finds them (a sweep folder holds several)."""
    out = []
    for d in run_dirs:
        out += [d] if (d / SAMPLES).exists() else sorted(p.parent for p in d.rglob(SAMPLES))
    return out


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing or unreadable (the gate reports why elsewhere)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# --- the verdict -------------------------------------------------------------------------------------------------


def verdict_view(run_dirs: list[Path], records: Records, thresholds: Thresholds, explicit: bool) -> VerdictView:
    """The verdict.json the gate wrote for exactly these runs when it is newer than every row, else the gate's
    judgement now with `thresholds` (always, when `explicit`: the user asked for those thresholds)."""
    path = run_dirs[0] / VERDICT
    doc = None if explicit else read_json(path)
    why_not = ""
    if doc is not None:
        why_not = _stale(doc, path, run_dirs)
        if not why_not:
            return _from_doc(doc, f"{path} (written by the gate)")
    verdict = judge(records.rows, records.infos, thresholds, records.problems, records.partial)
    verdict.runs = [str(d) for d in run_dirs]
    doc = verdict_doc(verdict, thresholds)
    given = "the thresholds given with --gate" if explicit else "the gate's default thresholds"
    why_not = why_not or ("" if explicit else f"no {path}")
    source = f"judged now by the report with {given}" + (f" ({why_not})" if why_not else "")
    return _from_doc(doc, source)


def _stale(doc: dict, path: Path, run_dirs: list[Path]) -> str:
    """Why a verdict.json does not speak for these runs now ('' when it does)."""
    judged = [Path(r) for r in doc.get("runs") or []]
    if judged and not _same_runs(judged, run_dirs):
        return f"{path} judged other runs"
    if not judged and len(run_dirs) > 1:
        return f"{path} does not say which runs it judged"
    written = path.stat().st_mtime
    if any((run / SAMPLES).stat().st_mtime > written for run in run_folders(run_dirs)):
        return f"{path} is older than the records"
    return ""


def _same_runs(judged: list[Path], run_dirs: list[Path]) -> bool:
    """The folders a verdict names are these runs: the same paths, or, for a path the gate was given relative to
    another working directory, the same trailing folders."""
    runs = [d.resolve() for d in run_dirs]

    def names(p: Path, r: Path) -> bool:
        return p.resolve() == r or (not p.is_absolute() and r.parts[-len(p.parts) :] == p.parts)

    matched = {next((r for r in runs if names(p, r)), None) for p in judged}
    return len(judged) == len(runs) and matched == set(runs)


def _from_doc(doc: dict[str, Any], source: str) -> VerdictView:
    variants = doc.get("variants") or {}
    advice = doc.get("advice")
    status = str(doc.get("verdict") or doc.get("status") or "CANNOT JUDGE")
    return VerdictView(
        status=status,
        reasons=[str(r) for r in doc.get("reasons") or []],
        thresholds=dict(doc.get("thresholds") or {}),
        source=source,
        not_judged=[str(c) for c in doc.get("not_judged") or []],
        advice=advice,
        extend=doc.get("extend") if status == "INCONCLUSIVE" else None,
        looks=_looks(doc),
        cells=[c for c in doc.get("cells") or [] if isinstance(c, dict)],
        variant_status={
            name: str((s.get("gate") or {}).get("status"))
            for name, s in variants.items()
            if isinstance(s, dict) and (s.get("gate") or {}).get("status")
        },
    )


def _looks(doc: dict[str, Any]) -> Any:
    """The number of looks a sequential gate has spent, from whichever form the verdict gives it."""
    looks = doc.get("looks", doc.get("look"))
    if isinstance(looks, list):
        return len(looks)
    if isinstance(looks, dict):
        return looks.get("count", looks.get("n", looks.get("look")))
    return looks


# --- the runs ----------------------------------------------------------------------------------------------------


def group_of(label: str) -> str:
    """The model/task prefix of a merged label (analysis.merge), '' for the variants of a single run."""
    return label.split(" [")[0].rpartition("/")[0]


def own_variant(label: str) -> str:
    """The variant as its run recorded it: the merged label without its prefix and its [folder]."""
    return label.split(" [")[0].rpartition("/")[2]


@dataclass
class Line:
    """Where a row lies: its file, its line number, and the line as written."""

    path: Path
    number: int
    text: str


def row_lines(folders: list[Path]) -> dict[tuple, Line]:
    """(run id, sample id, variant) -> the first line that records it, for every readable row of every folder."""
    out: dict[tuple, Line] = {}
    for folder in folders:
        path = folder / SAMPLES
        try:
            lines = path.read_text(errors="replace").split("\n")  # editors count lines by \n only
        except OSError:
            continue
        for n, text in enumerate(lines, start=1):
            try:
                row = json.loads(text)
            except ValueError:
                continue
            if isinstance(row, dict) and "sample_id" in row and "variant" in row:
                sid, variant = row["sample_id"], row["variant"]
                for key in ((row.get("run_id"), sid, variant), (None, sid, variant)):
                    out.setdefault(key, Line(path, n, text))
    return out


def line_of(row: dict[str, Any], lines: dict[tuple, Line]) -> Line | None:
    sid, variant = row["sample_id"], own_variant(row["variant"])
    return lines.get((row.get("run_id"), sid, variant)) or lines.get((None, sid, variant))


def run_panel(folder: Path) -> dict[str, Any]:
    """A run's own facts for its panel: task and its settings, model, backend, protocol, versions, what it holds."""
    info = read_json(folder / RUN) or {}
    config = info.get("config") or {}
    task = {k: v for k, v in (config.get("task") or {}).items() if not str(k).startswith("_")}
    model = info.get("model") or {}
    rows = _rows(folder / SAMPLES)
    variants = sorted({r.get("variant") for r in rows if isinstance(r.get("variant"), str)})
    # rows name the engine that produced them where a backend other than evalkit's own (transformers) ran
    backends = sorted({str(r["backend"]) for r in rows if r.get("backend")})
    backends = backends or [str(config.get("backend") or "transformers (evalkit's engine)")]
    return {
        "folder": str(folder),
        "run_id": info.get("run_id", "-"),
        "task": task.get("name") or next((r.get("task") for r in rows if r.get("task")), "-"),
        "task_settings": {k: _short(v) for k, v in task.items() if k != "name"},
        "model": model.get("name") or (config.get("model") or {}).get("name", "-"),
        "fingerprint": str(model.get("fingerprint") or "-")[:12],
        "backend": ", ".join(backends),
        "protocol": info.get("protocol", "-"),
        "started": info.get("started", "-"),
        "versions": {
            k: str(v)[:12] if k.endswith("_git") else v
            for k, v in (info.get("versions") or {}).items()
            if k in VERSIONS
        },  # fmt: skip
        "samples": len({r.get("sample_id") for r in rows}),
        "variants": [v for v in variants if not is_baseline(v)],
        "extra_files": sorted(p.name for p in folder.glob("*.json") if p.name not in (RUN, VERDICT, "summary.json")),
    }


def _rows(path: Path) -> list[dict]:
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}); fix its permissions") from None
    for line in text.split("\n"):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"
