"""Measured variants for the capacity table (plan.runs): each run's variants with their KV bytes as a deployment
holds them and the gate's verdict, judged again from the records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.gate.decide import SHOWN_TO_FAIL
from evalkit.gate.judge import judge
from evalkit.gate.outputs import VERDICT
from evalkit.gate.reading import read_runs
from evalkit.gate.summary import is_baseline, summarize
from evalkit.gate.thresholds import load_thresholds, thresholds


def measured_variants(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """Each variant of each run folder: its KV bytes as a deployment holds them, their ratio to the full cache's
    (measured on the run's model), and the gate's verdict on it, judged here from the records (with the thresholds of
    the folder's verdict.json where it holds one, else conf/gate/default.yaml): a verdict.json is never believed."""

    out = []
    for d in run_dirs:
        if not d.is_dir():
            raise ConfigError(f"plan.runs: {d} is not a folder; give evalkit run folders (results/...)")
        records = read_runs([d])
        if records.problems:
            raise ConfigError(f"plan.runs: {d}: {records.problems[0]}")
        if not records.rows:
            raise ConfigError(f"plan.runs: {d} holds no records (samples.jsonl); give a finished evalkit run")
        written = _read_verdict(d / VERDICT)
        t = thresholds(written["thresholds"], f"in {d / VERDICT}") if written else load_thresholds("default")
        verdict = judge(records.rows, records.infos, t)
        model = ((records.infos[0] if records.infos else {}).get("model") or {}).get("name")
        for name, s in summarize(records.rows).items():
            if is_baseline(name):
                continue
            status = ((verdict.variants.get(name) or {}).get("gate") or {}).get("status") or verdict.status
            failed = failed_cells({"cells": verdict.cells}, name)
            reasons = [r for r in verdict.reasons if r.startswith(f"{name}:")]
            why = f"on cells {', '.join(failed)}" if failed else (reasons[0] if reasons else "")
            if status != "FAIL" and verdict.status == "CANNOT JUDGE":
                status, why = "CANNOT JUDGE", (verdict.reasons or [""])[0]
            if not written:  # no thresholds to judge with but the default ones: say so
                why = "; ".join(filter(None, ["judged here at conf/gate/default.yaml", why]))
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


def _read_verdict(path: Path) -> dict | None:
    """A folder's verdict.json, for its thresholds only (the verdict itself is judged again): None where there is
    none or it holds no thresholds."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot be read ({err}); delete it, or judge the run again") from None
    return doc if isinstance(doc, dict) and isinstance(doc.get("thresholds"), dict) else None


def failed_cells(verdict: dict, name: str) -> list[str]:
    """The cells of `name` that the gate showed to fail, from a verdict.json ("no failure shown" and "not judged:
    ..., a failure here can be shown from N" are not failures)."""

    return [c["cell"] for c in verdict.get("cells", []) if c["variant"] == name and c["status"] == SHOWN_TO_FAIL]
