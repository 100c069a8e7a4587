"""What the report page shows, as plain data: the verdict, the runs, and where each row lies in its samples.jsonl.

The verdict is the gate's own verdict.json, shown only where it judged exactly these runs and these rows and says
what the gate's last look recorded (evalkit.records.shown, the planner's check too); the report never judges, since
every judgement is a look the gate records. Otherwise the page says there is no verdict for these rows and the command
that judges them. Fields of verdict.json are read with defaults, so a verdict written by a newer gate still renders.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalkit.errors import EXIT_FAIL, EXIT_OK, ConfigError
from evalkit.records import RUN, SAMPLES, Row, loads
from evalkit.records.merged import is_baseline, variant_name
from evalkit.records.reading import Records
from evalkit.records.shown import NO_VERDICT, shown_verdict
from evalkit.records.verdict import VERDICT, drop_bound, headline_text, note_lines

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
    # the drop bound the gate decided on, per variant: {"bounds": [lower, upper], "method"} (records.verdict.drop_bound)
    drop: dict[str, dict[str, Any]] = field(default_factory=dict)
    headline: str = ""  # the console's first line (a PASS at thresholds other than the defaults says so)
    notes: list[str] = field(default_factory=list)  # the console's notes: unfinished, declared bytes, thresholds
    search: dict[str, Any] | None = None  # a budget search's answer (verdict.json `search`), else None

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
        doc = loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# --- the verdict -------------------------------------------------------------------------------------------------


def verdict_view(run_dirs: list[Path], records: Records) -> VerdictView:
    """The verdict.json the gate wrote for exactly these runs and rows (evalkit.records.shown, the planner's check too),
    else NO VERDICT with why and the command that judges them (the report never judges: each judgement is a look,
    recorded by the gate)."""
    doc, why = shown_verdict(run_dirs, records)
    if doc is not None:
        return _from_doc(doc, f"{run_dirs[0] / VERDICT} (written by the gate)")
    command = "python -m evalkit.gate " + " ".join(shlex.quote(str(d)) for d in run_dirs)
    return VerdictView(NO_VERDICT, [f"no verdict for these rows: run {command}"], {}, why)


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
        drop={name: b for name, s in variants.items() if (b := drop_bound(s)) is not None},
        headline=headline_text(status, _texts(doc, "declared_bytes"), _texts(doc, "non_default_thresholds")),
        notes=note_lines(*(_texts(doc, k) for k in ("unfinished", "declared_bytes", "non_default_thresholds"))),
        search=doc.get("search") if isinstance(doc.get("search"), dict) else None,
    )


def _texts(doc: dict[str, Any], key: str) -> list[str]:
    value = doc.get(key)
    return [str(x) for x in value] if isinstance(value, list) else []


def _looks(doc: dict[str, Any]) -> Any:
    """The look number of the verdict (evalkit.records.looks), from whichever form the verdict gives it."""
    looks = doc.get("looks", doc.get("look"))
    if isinstance(looks, list):
        return len(looks)
    if isinstance(looks, dict):
        return looks.get("count", looks.get("n", looks.get("look")))
    return looks


# --- the runs ----------------------------------------------------------------------------------------------------


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
                row = loads(text)
            except ValueError:
                continue
            if (
                isinstance(row, dict)
                and isinstance(row.get("sample_id"), (str, int))
                and isinstance(row.get("variant"), str)
            ):
                sid, variant = row["sample_id"], row["variant"]
                run_id = row.get("run_id") if isinstance(row.get("run_id"), str) else None
                for key in ((run_id, sid, variant), (None, sid, variant)):
                    out.setdefault(key, Line(path, n, text))
    return out


def line_of(row: Row, lines: dict[tuple, Line]) -> Line | None:
    sid, variant = row.sample_id, variant_name(row.variant)
    return lines.get((row.run_id, sid, variant)) or lines.get((None, sid, variant))


def run_panel(folder: Path) -> dict[str, Any]:
    """A run's own facts for its panel: task and its settings, model, backend, protocol, versions, what it holds."""
    info = read_json(folder / RUN) or {}
    config, model = (v if isinstance(v, dict) else {} for v in (info.get("config"), info.get("model")))
    task = config.get("task") if isinstance(config.get("task"), dict) else {}
    task = {k: v for k, v in task.items() if not str(k).startswith("_")}
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
            for k, v in (info.get("versions") if isinstance(info.get("versions"), dict) else {}).items()
            if k in VERSIONS
        },  # fmt: skip
        "samples": len({json.dumps(r.get("sample_id"), default=str) for r in rows}),
        "variants": [v for v in variants if not is_baseline(v)],
        "extra_files": sorted(p.name for p in folder.glob("*.json") if p.name not in (RUN, VERDICT, "summary.json")),
    }


def _rows(path: Path) -> list[dict]:
    """Every JSON object of a samples.jsonl, read leniently: a run's panel describes a folder the gate may refuse."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err}); fix its permissions") from None
    for line in text.split("\n"):
        try:
            row = loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"
