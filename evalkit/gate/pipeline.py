"""What a CI system reads of a verdict: JUnit XML (one test case per variant and check, so Jenkins', GitLab's and
GitHub's test views show which variant failed and why) and a Markdown summary for GitHub's step summary.

Both are built from the verdict document (outputs.verdict_doc, what verdict.json holds) and decide nothing: a check
is a failure where the gate found it broken, skipped where it was not shown either way (INCONCLUSIVE), an error
where the records could not be judged.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.gate.decide import SHOWN_TO_FAIL
from evalkit.gate.summary import is_baseline

SUITE = "evalkit.gate"


def _reasons_of(doc: dict[str, Any], name: str) -> list[str]:
    return [r for r in doc.get("reasons") or [] if r.startswith(f"{name}: ")]


def cases(doc: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(classname, name, outcome, message) per variant and check, and one for the verdict as a whole; outcome is
    passed, failure, skipped or error."""
    out = []
    for name, s in (doc.get("variants") or {}).items():
        g = s.get("gate")
        if is_baseline(s.get("variant", name)) or not g:
            continue
        why = "; ".join(_reasons_of(doc, name))
        for what, c in (g.get("checks") or {}).items():
            outcome = "failure" if c.get("broken") else "passed" if c.get("holds") else "skipped"
            lo, hi = c.get("bounds") or (None, None)
            message = f"{what}: bounds [{lo}, {hi}] ({c.get('method')})" + (f"; {why}" if why else "")
            out.append((name, what, outcome, message))
        cells = [c for c in doc.get("cells") or [] if c.get("variant") == name]
        failed = [c for c in cells if c.get("status") == SHOWN_TO_FAIL]
        judged = [c for c in cells if not str(c.get("status", "")).startswith("not judged")]
        if cells:
            outcome = "failure" if failed else "passed" if judged else "skipped"
            message = (
                "; ".join(f"cell {c['cell']}: accuracy {c['policy']:.2f}, shown below the limit" for c in failed)
                or f"{len(judged)} of {len(cells)} cells judged, none shown to fail"
            )
            out.append((name, "cells", outcome, message))
    status = doc.get("verdict")
    outcome = {"PASS": "passed", "FAIL": "failure", "INCONCLUSIVE": "skipped"}.get(status, "error")
    message = "; ".join([*(doc.get("reasons") or []), *([doc["advice"]] if doc.get("advice") else [])])
    out.append(("verdict", str(status), outcome, message or "every threshold shown to hold"))
    return out


def junit_xml(doc: dict[str, Any]) -> str:
    """The verdict as a JUnit XML document (one <testsuite>, a <testcase> per variant and check)."""
    rows = cases(doc)
    count = {k: sum(1 for r in rows if r[2] == k) for k in ("failure", "skipped", "error")}
    suites = ET.Element("testsuites", name=SUITE)
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=SUITE,
        tests=str(len(rows)),
        failures=str(count["failure"]),
        errors=str(count["error"]),
        skipped=str(count["skipped"]),
    )
    for classname, name, outcome, message in rows:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name)
        if outcome != "passed":
            ET.SubElement(case, outcome, message=message[:2000]).text = message
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


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
            "| variant | status | n | accuracy (baseline) | drop | lost | gained | KV ratio |",
            "|---|---|---:|---|---:|---:|---:|---:|",
        ]
        for name, s in rows:
            p, g = s.get("paired") or {}, s.get("gate") or {}
            ratio = s.get("kv_ratio")
            lines.append(
                f"| `{_cell(name)}` | {g.get('status', '-')} | {s.get('n')} | {p.get('policy', 0):.2f} "
                f"({p.get('baseline', 0):.2f}) | {p.get('drop', 0):+.3f} | {p.get('lost')} | {p.get('gained')} | "
                f"{'-' if ratio is None else f'{ratio:.3f}'} |"
            )
        lines.append("")
    lines += [f"- {_cell(r)}" for r in doc.get("reasons") or []]
    if doc.get("advice"):
        lines += ["", f"To settle it: {doc['advice']}"]
    if doc.get("extend"):
        lines += ["", f"```\n{doc['extend']}\n```"]
    return "\n".join(lines) + "\n"


def write_ci(doc: dict[str, Any], junit: Path | None, summary: Path | None) -> None:
    """Write the JUnit file (replaced) and append the summary (GitHub's $GITHUB_STEP_SUMMARY is appended to)."""
    try:
        if junit is not None:
            junit.write_text(junit_xml(doc))
        if summary is not None:
            with summary.open("a") as f:
                f.write(step_summary(doc))
    except OSError as err:
        raise ConfigError(
            f"could not write {err.filename} ({err.strerror or err}): give --junit / --summary a writable path"
        ) from None
