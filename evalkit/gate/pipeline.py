"""What a CI system reads of a verdict: JUnit XML (evalkit.gate.junit) and a Markdown summary for GitHub's step
summary, both built from the verdict document (outputs.verdict_doc, what verdict.json holds), deciding nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.gate.junit import junit_xml
from evalkit.records.merged import is_baseline
from evalkit.records.verdict import drop_bound, search_table, signed


def _cell(text: Any) -> str:
    """User text (variant names) safe in a Markdown table cell."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def step_summary(doc: dict[str, Any]) -> str:
    """A Markdown summary of the verdict: its status, a line per variant, every reason and the advice."""
    lines = [f"## evalkit gate: {doc.get('verdict')}", ""]
    notes = [*(doc.get("unfinished") or [])]
    notes += [f"{name}: KV bytes declared, never observed" for name in doc.get("declared_bytes") or []]
    if doc.get("non_default_thresholds"):
        notes.append("thresholds other than the defaults: " + "; ".join(doc["non_default_thresholds"]))
    lines += [f"> {_cell(n)}" for n in notes] + ([""] if notes else [])
    rows = [(n, s) for n, s in (doc.get("variants") or {}).items() if not is_baseline(s.get("variant", n))]
    if rows:
        lines += [
            "| variant | status | n | accuracy (baseline) | drop | drop bounds (the gate's) | lost | gained "
            "| KV ratio |",
            "|---|---|---:|---|---:|---|---:|---:|---:|",
        ]
        for name, s in rows:
            p, g, bound = s.get("paired") or {}, s.get("gate") or {}, drop_bound(s)
            ratio = s.get("kv_ratio")
            shown = "-" if bound is None else f"[{signed(bound['bounds'][0])}, {signed(bound['bounds'][1])}] "
            shown += "" if bound is None else _cell(bound["method"])
            lines.append(
                f"| `{_cell(name)}` | {g.get('status', '-')} | {s.get('n')} | {p.get('policy', 0):.2f} "
                f"({p.get('baseline', 0):.2f}) | {p.get('drop', 0):+.3f} | {shown} | {p.get('lost')} | "
                f"{p.get('gained')} | {'-' if ratio is None else f'{ratio:.3f}'} |"
            )
        lines.append("")
    lines += [line.replace("\n", " ") for line in search_table(doc.get("search"))] + ([""] if doc.get("search") else [])
    lines += [f"- {_cell(r)}" for r in doc.get("reasons") or []]
    if doc.get("advice"):
        lines += ["", f"To settle it: {doc['advice']}"]
    if doc.get("extend"):
        lines += ["", f"```\n{doc['extend']}\n```"]
    return "\n".join(lines) + "\n"


def write_ci(doc: dict[str, Any], junit: Path | None, summary: Path | None) -> None:
    """Write the JUnit file (replaced) and append the summary (GitHub's $GITHUB_STEP_SUMMARY is appended to), each
    folder created where missing (as pytest's --junitxml does); a ConfigError naming the path that failed."""
    for path, text, mode in ((junit, junit_xml, "w"), (summary, step_summary, "a")):
        if path is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open(mode) as f:
                f.write(text(doc))
        except OSError as err:
            raise ConfigError(
                f"could not write {path} ({err.strerror or err}): give --junit / --summary a writable path"
            ) from None
