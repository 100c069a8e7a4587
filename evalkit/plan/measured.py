"""Measured variants for the capacity table (plan.runs): each run's variants with their KV bytes as a deployment
holds them and the gate's verdict from the run's verdict.json, where it judged exactly the rows the folder holds now
and says what the gate's last look recorded (evalkit.records.shown, the report's check too; the planner never judges:
each judgement is a look, recorded by the gate)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.records.merged import is_baseline, label_order
from evalkit.records.reading import read_runs
from evalkit.records.shown import NO_VERDICT, shown_verdict
from evalkit.records.summary import summarize
from evalkit.records.verdict import SHOWN_TO_FAIL


def measured_variants(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """Each variant of each run folder: its KV bytes as a deployment holds them, their ratio to the full cache's
    (measured on the run's model), and the gate's verdict on it from the folder's verdict.json (NO VERDICT, with the
    command that judges it, where none matches the rows)."""

    out = []
    for d in run_dirs:
        if not d.is_dir():
            raise ConfigError(f"plan.runs: {d} is not a folder; give evalkit run folders (results/...)")
        records = read_runs([d])
        if records.problems:
            raise ConfigError(f"plan.runs: {d}: {records.problems[0]}")
        if not records.rows:
            raise ConfigError(f"plan.runs: {d} holds no records (samples.jsonl); give a finished evalkit run")
        doc, unshown = shown_verdict([d], records)
        model = ((records.infos[0] if records.infos else {}).get("model") or {}).get("name")
        for name, s in summarize(records.rows, label_order).items():
            if is_baseline(name):
                continue
            status, why = _status(doc, name, d, unshown)
            out.append(
                {
                    "variant": name,
                    "run": str(d),
                    "model": model,
                    "n": s["n"],
                    "kv_ratio": s["kv_ratio"],
                    "kv_ratio_basis": s["kv_ratio_basis"],
                    "kv_bytes_per_token": s["kv_bytes_per_token"],
                    "status": status,
                    "why": why,
                }
            )
    return out


def _status(doc: dict | None, name: str, folder: Path, unshown: str = "") -> tuple[str, str]:
    """A variant's status and why, from the gate's verdict.json for these rows (None: there is none, `unshown` says
    why)."""
    if doc is None:
        because = f" ({unshown})" if unshown else ""
        return NO_VERDICT, f"no verdict for these rows: run python -m evalkit.gate {shlex.quote(str(folder))}{because}"
    verdict = str(doc.get("verdict") or "CANNOT JUDGE")
    gate = ((doc.get("variants") or {}).get(name) or {}).get("gate") or {}
    status = str(gate.get("status") or verdict)
    reasons = [str(r) for r in doc.get("reasons") or []]
    failed = failed_cells(doc, name)
    mine = [r for r in reasons if r.startswith(f"{name}:")]
    why = f"on cells {', '.join(failed)}" if failed else (mine[0] if mine else "")
    if status != "FAIL" and verdict == "CANNOT JUDGE":
        status, why = "CANNOT JUDGE", (reasons or [""])[0]
    return status, why


def failed_cells(verdict: dict, name: str) -> list[str]:
    """The cells of `name` that the gate showed to fail, from a verdict.json ("no failure shown" and "not judged:
    ..., a failure here can be shown from N" are not failures)."""

    cells = [c for c in verdict.get("cells") or [] if isinstance(c, dict)]
    return [str(c.get("cell")) for c in cells if c.get("variant") == name and c.get("status") == SHOWN_TO_FAIL]
