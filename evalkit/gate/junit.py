"""The verdict as JUnit XML: one test case per variant and check, so Jenkins', GitLab's and GitHub's test views show
which variant failed and why. Built from the verdict document (outputs.verdict_doc, what verdict.json holds), it
decides nothing. A case passes only where the gate showed its check to hold: a check shown broken is a failure, one
shown neither way (INCONCLUSIVE) a failure too, and records that could not be judged an error. Nothing else is
skipped, so nothing that is not a PASS is green; in a budget search the budgets past a policy's answer are skipped
(the search reports them, it does not fail on them) and each policy has a `safe_budget` case. Cases are named by what
they test, never by the outcome: `evalkit.<task>.<variant>` (dots and other characters a CI system reads as structure
made `_`) and the check, so a PASS turning FAIL is one case failing.
"""

from __future__ import annotations

import hashlib
import re
import xml.etree.ElementTree as ET
from typing import Any

from evalkit.records.merged import is_baseline
from evalkit.records.verdict import SHOWN_TO_FAIL

SUITE = "evalkit.gate"
WHOLE = ("evalkit", "verdict")  # the case of the verdict as a whole: the same name whatever the status
LIMITS = {"drop": "max_drop", "flips": "max_flip_rate", "kl": "max_mean_kl", "kl_tail": "max_kl_tail_share"}
# The gate's reasons of a variant by the check they concern (its reasons start "<variant>: "; decide.fail_message,
# open_messages, judge.cell_reasons and record_reasons word them), first match wins; a reason that names none of
# these falls to the variant's own `status` case, so that no reason is left without a failing case.
CONCERNS = (
    ("status", ("each document weighed by its questions",)),  # documents' figures hold, questions' do not
    ("cells", ("cell ",)),
    ("prefill_bound", ("chunked prefill held",)),
    ("compression", ("compression was asked",)),
    ("samples", ("fewer than gate.min_samples",)),
    ("drop", ("accuracy drop", "the drop may be")),
    ("flips", ("flip-rate limit", "the flip rate may be", "flip rate")),
    ("kl_tail", ("over max_kl_tail_share", "below max_kl_tail_share")),  # before kl: its words name the tail too
    ("kl", ("mean KL",)),
)
RECORD_CHECKS = ("samples", "prefill_bound", "compression", "runs")  # a case each for every judged variant
# What XML 1.0 cannot hold (control characters, lone surrogates, U+FFFE/U+FFFF): removed from every name and message
ILLEGAL = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
UNSAFE = re.compile(r"[^A-Za-z0-9_@+=-]")  # a classname part keeps these; `.` would split it into packages


def _safe(text: Any) -> str:
    return UNSAFE.sub("_", str(text)) or "_"


def _num(x: Any) -> str:
    """A number in a message: 4 significant digits (`none` where there is none)."""
    return f"{x:.4g}" if isinstance(x, (int, float)) and x == x else "none"


def _concern(name: str, reason: str) -> str:
    """The check a reason of variant `name` concerns (`status`: none of them)."""
    text = reason[len(name) + 2 :]
    return next((check for check, words in CONCERNS if any(w in text for w in words)), "status")


def classnames(doc: dict[str, Any]) -> dict[str, str]:
    """Each variant's classname: `evalkit.<task>.<variant>`, the parts made safe; where two variants would share
    one, each gets a short digest of its own name, so that no two variants' cases merge."""
    out = {}
    for name, s in (doc.get("variants") or {}).items():
        task = str(((s.get("run") or {}) if isinstance(s, dict) else {}).get("task") or "")
        label = name[len(task) + 1 :] if task and name.startswith(f"{task}/") else name
        out[name] = ".".join(["evalkit", *([_safe(task)] if task else []), _safe(label)])
    seen: dict[str, int] = {}
    for c in out.values():
        seen[c] = seen.get(c, 0) + 1
    return {n: c if seen[c] == 1 else f"{c}_{hashlib.sha256(n.encode()).hexdigest()[:6]}" for n, c in out.items()}


def _outcome(status: str) -> str:
    """A case's outcome from a status: PASS passes, FAIL and INCONCLUSIVE fail, anything else is an error."""
    return {"PASS": "passed", "FAIL": "failure", "INCONCLUSIVE": "failure"}.get(status, "error")


def cases(doc: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(classname, name, outcome, type, message) per judged variant and check, and one for the verdict as a whole;
    outcome is passed, failure or error; type the status behind it (FAIL, INCONCLUSIVE, CANNOT JUDGE)."""
    reasons = [str(r) for r in doc.get("reasons") or []]
    variants = {n: s for n, s in (doc.get("variants") or {}).items() if isinstance(s, dict)}
    judged = {n: s for n, s in variants.items() if s.get("gate") and not is_baseline(s.get("variant", n))}
    mine = {n: [r for r in reasons if r.startswith(f"{n}: ")] for n in judged}
    whole = [r for r in reasons if not any(r in rs for rs in mine.values())]  # the runs', not one variant's
    classname, out = classnames(doc), []
    for name, s in judged.items():
        g, by_check = s["gate"], {}
        for r in mine[name]:
            by_check.setdefault(_concern(name, r), []).append(r)
        for what, c in (g.get("checks") or {}).items():
            out.append((classname[name], what, *_check(what, c, doc, by_check.get(what, []))))
        cells = [c for c in doc.get("cells") or [] if isinstance(c, dict) and c.get("variant") == name]
        if cells:
            out.append((classname[name], "cells", *_cells(cells, g.get("status"), by_check.get("cells", []))))
        for what in RECORD_CHECKS:
            # the runs' reasons (mixed runs: FAIL; unfinished: INCONCLUSIVE) hold back every variant
            own, kind = (whole, str(doc.get("verdict"))) if what == "runs" else (by_check.get(what, []), "FAIL")
            out.append((classname[name], what, *((_outcome(kind), kind, "; ".join(own)) if own else _held(what))))
        own_cases = [c for c in out if c[0] == classname[name]]
        status = _status(str(g.get("status")), [c[3] for c in own_cases])
        short = [c[1] for c in own_cases if c[2] != "passed"]
        said = f"checks not shown to hold: {', '.join(short)}" if short else "every check shown to hold"
        message = "; ".join([f"{status}: {said}", *by_check.get("status", [])])
        out.append((classname[name], "status", _outcome(status), status, message))
    out = _searched(doc, out, classname)
    status = str(doc.get("verdict"))
    failing = [n for n, s in judged.items() if s["gate"].get("status") != "PASS" or mine[n]]
    failing = [n for n in failing if n not in beyond_answer(doc)]
    message = "; ".join(
        [
            status,
            *([f"variants not passing: {', '.join(failing)}"] if failing else []),
            *whole,
            *([str(doc["advice"])] if doc.get("advice") else []),
        ]
    )
    out.append((*WHOLE, _outcome(status), status, message))
    return out


def beyond_answer(doc: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """In a budget search, the variants past each policy's answer (below its safe budget, or below its largest
    budget where it has none), with their status in the search and the policy's statement: the search decided on
    the policy at its answer, and the budgets past it are what it reports, not what it fails on."""
    search = doc.get("search") if isinstance(doc.get("search"), dict) else {}
    out = {}
    for entry in (search.get("policies") or {}).values():
        steps = entry.get("steps") or []
        cut = next((i for i, st in enumerate(steps) if st.get("status") != "PASS"), len(steps))
        for st in steps[max(cut, 1) :]:
            out[str(st.get("variant"))] = (str(st.get("status")), str(entry.get("statement")))
    return out


def _searched(doc: dict[str, Any], out: list, classname: dict[str, str]) -> list:
    """A budget search's cases: the variants past each policy's answer skipped (their status in the search and the
    policy's statement as the message: neither green nor a failure), and a case per policy, `safe_budget`, passed
    where the policy is shown safe at a budget, its statement and what the safe budget buys as the message."""
    if not isinstance(doc.get("search"), dict):
        return out
    past = beyond_answer(doc)
    by_class = {classname[n]: past[n] for n in past if n in classname}
    kept = []
    for case in out:
        if case[0] in by_class:
            status, said = by_class[case[0]]
            case = (case[0], case[1], "skipped", status, f"budget search: {status} at this budget ({said}); {case[4]}")
        kept.append(case)
    for chain, entry in (doc["search"].get("policies") or {}).items():
        status = str(entry.get("status"))
        capacity = entry.get("capacity") if isinstance(entry.get("capacity"), dict) else {}
        said = "; ".join([str(entry.get("statement")), *([str(capacity["text"])] if capacity.get("text") else [])])
        kept.append((f"evalkit.search.{_safe(chain)}", "safe_budget", _outcome(status), status, said))
    return kept


def _status(decided: str, kinds: list[str]) -> str:
    """A variant's status over all its cases: FAIL where any check is shown broken (its cells and records too, which
    the statistical decision leaves out), else not PASS where any case is short of one."""
    if decided == "FAIL" or "FAIL" in kinds:
        return "FAIL"
    return next((k for k in kinds if k != "PASS"), decided) if decided == "PASS" else decided


def _held(what: str) -> tuple[str, str, str]:
    words = {
        "samples": "at least gate.min_samples contexts",
        "prefill_bound": "no chunked prefill over its bound (budget + chunk)",
        "compression": "no compression asked, or its KV bytes below min_compression of the full cache's",
        "runs": "the runs are one configuration (protocol, library versions, model weights), and finished",
    }
    return "passed", "PASS", words[what]


def _check(what: str, c: dict[str, Any], doc: dict[str, Any], own: list[str]) -> tuple[str, str, str]:
    """A statistical check's case: passed where shown to hold, a failure where shown broken or shown neither way."""
    lo, hi = c.get("bounds") or (None, None)
    limit = (doc.get("thresholds") or {}).get(LIMITS.get(what, ""))
    status = "FAIL" if c.get("broken") else "PASS" if c.get("holds") else "INCONCLUSIVE"
    said = {"FAIL": "shown over", "PASS": "shown within", "INCONCLUSIVE": "not shown within"}[status]
    head = f"{what} {said} the limit {_num(limit)}: bounds [{_num(lo)}, {_num(hi)}] ({c.get('method')})"
    return _outcome(status), status, "; ".join([head, *own])


def _cells(cells: list[dict], status: Any, own: list[str]) -> tuple[str, str, str]:
    """The cells' case: a failure where a cell is shown below min_cell_accuracy; passed only where the variant PASSes
    (a cell can be shown to fail, never to hold: with the variant short of a PASS, no cell is vouched for)."""
    failed = [c for c in cells if c.get("status") == SHOWN_TO_FAIL]
    judged = [c for c in cells if not str(c.get("status", "")).startswith("not judged")]
    if failed:
        return "failure", "FAIL", "; ".join(own) or "; ".join(f"cell {c.get('cell')}: shown to fail" for c in failed)
    seen = f"{len(judged)} of {len(cells)} cells judged, none shown to fail"
    if status == "PASS":
        return "passed", "PASS", seen
    return _outcome(str(status)), str(status), f"{seen}, but the variant is {status}, so no cell is vouched for"


def _clean(text: Any) -> str:
    return ILLEGAL.sub("", str(text))


def junit_xml(doc: dict[str, Any]) -> str:
    """The verdict as a JUnit XML document (one <testsuite>, a <testcase> per variant and check)."""
    rows = cases(doc)
    count = {k: sum(1 for r in rows if r[2] == k) for k in ("failure", "error", "skipped")}
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
    for classname, name, outcome, kind, message in rows:
        case = ET.SubElement(suite, "testcase", classname=_clean(classname), name=_clean(name))
        if outcome != "passed":  # failure, error, or skipped (a budget past a search's answer)
            text = _clean(message)
            ET.SubElement(case, outcome, message=text[:2000], type=_clean(kind)).text = text
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"
