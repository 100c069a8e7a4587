"""Every output says what the gate decided, in the gate's numbers, and shows verdict.json only as the gate wrote it.

JUnit: a case per (variant, check), named by what it tests, passed only where the gate showed the check to hold
(INCONCLUSIVE and CANNOT JUDGE fail or error, never skip), a failure on the check a reason concerns, XML that
parsers accept. One drop bound per variant: the gate's, with its method; a fixed-n interval beside it is labelled
descriptive. verdict.json is shown by the report and the planner only where the last look of looks.jsonl records its
verdict, reasons and digest, the looks numbered 1, 2, 3. All on real tiny-random run folders
(tests.test_machine_outputs).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from evalkit.cli.gate import main as gate_main
from evalkit.gate.contexts import KL_CAP_FACTOR
from evalkit.gate.junit import junit_xml
from evalkit.plan.measured import measured_variants
from evalkit.records.looks import LOOKS_FILE
from evalkit.records.verdict import verdict_fields
from evalkit.report.__main__ import main as report_main
from tests.conftest import ROOT
from tests.test_machine_outputs import KINDS, WIDE, junit_cases, make_tiny_runs

LOSSY = "streaming_llm@0.25"
LOSSY_CLASS = "evalkit.needle.streaming_llm@0_25"  # `.` in a classname is a package separator to Jenkins


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> dict[str, Path]:
    """tests.test_machine_outputs' real runs: `lossless` (streaming_llm@1.0) and `lossy` (streaming_llm@0.25)."""
    return make_tiny_runs(tmp_path_factory.mktemp("agree"))


def _copy(tiny_runs, name: str, tmp_path: Path) -> Path:
    """A copy of a real run folder: each test records its own looks."""
    return Path(shutil.copytree(tiny_runs[name], tmp_path / name))


def _gate(run: Path, tmp_path: Path, thresholds: str, *args: str) -> int:
    tmp_path.mkdir(parents=True, exist_ok=True)
    gate_file = tmp_path / "gate.yaml"
    gate_file.write_text(f"name: test\n{thresholds}")
    return gate_main([str(run), "--gate", str(gate_file), *args])


def _parse_everywhere(path: Path) -> None:
    """The file parses with ElementTree and, where installed, lxml (stricter about characters)."""
    ET.parse(path)
    if importlib.util.find_spec("lxml") is not None:
        from lxml import etree

        etree.parse(str(path))


def _junit(run: Path, tmp_path: Path, kind: str) -> tuple[int, ET.Element, dict]:
    _, thresholds, _, _ = KINDS[kind]
    junit = tmp_path / "gate.xml"
    code = _gate(run, tmp_path, thresholds, "--junit", str(junit), "--out", str(tmp_path / "v"))
    _parse_everywhere(junit)
    suite, cases = junit_cases(junit)
    return code, suite, cases


# --- JUnit ------------------------------------------------------------------------------------------------------


def test_a_lossless_pass_is_all_green_and_a_lossy_fail_fails_on_compression(tiny_runs, tmp_path):
    code, suite, cases = _junit(_copy(tiny_runs, "lossless", tmp_path), tmp_path / "pass", "pass")
    assert code == 0 and (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("0", "0", "0")
    assert set(cases.values()) == {"passed"} and cases["evalkit", "verdict"] == "passed"

    # FAIL on compression only (a quarter of the cache over min_compression=0.01): once every check case passed
    # and only the verdict failed; now the compression case fails, with its own reason and no other
    code, suite, cases = _junit(_copy(tiny_runs, "lossy", tmp_path), tmp_path / "fail", "fail")
    assert code == 1
    assert cases[LOSSY_CLASS, "compression"] == "failure" and cases["evalkit", "verdict"] == "failure"
    root = ET.parse(tmp_path / "fail" / "gate.xml").getroot()
    messages = {
        (c.get("classname"), c.get("name")): (c[0].get("message") if len(c) else "") for c in root.iter("testcase")
    }
    assert "compression was asked" in messages[LOSSY_CLASS, "compression"]
    for check in ("drop", "flips", "cells", "prefill_bound", "runs"):
        assert "compression was asked" not in messages.get((LOSSY_CLASS, check), ""), check
    # 4 significant digits at most in every message (bounds were printed to 17 digits)
    assert not re.search(r"\d\.\d{5,}", " ".join(messages.values()))


def test_inconclusive_and_cannot_judge_are_never_green_nor_skipped(tiny_runs, tmp_path):
    run = _copy(tiny_runs, "lossy", tmp_path)
    code, suite, cases = _junit(run, tmp_path / "inc", "inconclusive")
    assert code == 2 and suite.get("skipped") == "0" and "skipped" not in cases.values()
    assert int(suite.get("failures")) + int(suite.get("errors")) > 0
    assert cases["evalkit", "verdict"] in ("failure", "error")
    assert cases[LOSSY_CLASS, "cells"] != "passed"  # 9 samples show no cell holding: not vouched for
    assert cases[LOSSY_CLASS, "status"] != "passed"
    code, suite, cases = _junit(run, tmp_path / "cannot", "cannot-judge")
    assert code == 2 and suite.get("skipped") == "0" and cases == {("evalkit", "verdict"): "error"}


def test_case_names_do_not_change_with_the_outcome(tiny_runs, tmp_path):
    """The same lossy run PASSes at wide thresholds and FAILs when min_compression is 0.01: the same cases, so a PASS
    turning FAIL is cases failing, not one test vanishing and another appearing (the verdict was `name="FAIL"`)."""
    run = _copy(tiny_runs, "lossy", tmp_path)
    base = WIDE + "min_baseline_accuracy: null\n"
    names = {}
    for status, extra in (("PASS", ""), ("FAIL", "min_compression: 0.01\n")):
        junit = tmp_path / f"{status}.xml"
        assert _gate(run, tmp_path, base + extra, "--junit", str(junit), "--out", str(tmp_path / status)) == (
            0 if status == "PASS" else 1
        )
        _, cases = junit_cases(junit)
        names[status] = set(cases)
        assert {cls for cls, _ in cases} == {LOSSY_CLASS, "evalkit"}  # evalkit.<task>.<variant>, dots made safe
    assert names["PASS"] == names["FAIL"] and ("evalkit", "verdict") in names["PASS"]


def test_a_control_character_in_a_variant_name_writes_xml_parsers_accept(tiny_runs, tmp_path):
    """A real run's verdict with its variant named `a\\x01b.c` (policy.name=a\\x01b): the XML once held the control
    character, which ElementTree and lxml refuse; a lone surrogate and a vertical tab in a reason likewise."""
    run = _copy(tiny_runs, "lossless", tmp_path)
    assert _gate(run, tmp_path, KINDS["pass"][1]) == 0
    doc = json.loads((run / "verdict.json").read_text())
    doc["variants"] = {"a\x01b.c" if k != "baseline" else k: v for k, v in doc["variants"].items()}
    doc["reasons"] = ["a\x01b.c: x\x0b \ud800y"]
    junit = tmp_path / "gate.xml"
    junit.write_text(junit_xml(doc))
    _parse_everywhere(junit)
    _, cases = junit_cases(junit)
    assert ("evalkit.needle.a_b_c", "drop") in cases and ("evalkit", "verdict") in cases


def test_junit_and_summary_folders_are_created_and_a_failed_write_names_its_path(tiny_runs, tmp_path, capsys):
    run = _copy(tiny_runs, "lossless", tmp_path)
    summary, junit = tmp_path / "deep" / "er" / "summary.md", tmp_path / "ci" / "nested" / "gate.xml"
    args = ["--summary", str(summary), "--junit", str(junit), "--out", str(tmp_path / "v")]
    assert _gate(run, tmp_path, KINDS["pass"][1], *args) == 0  # folders that did not exist: created, as pytest does
    assert summary.read_text().startswith("## evalkit gate: PASS") and junit_cases(junit)[1]
    if Path("/dev/full").exists():
        assert _gate(run, tmp_path, KINDS["pass"][1], "--summary", "/dev/full", "--out", str(tmp_path / "v")) == 2
        err = capsys.readouterr().err
        assert "could not write /dev/full" in err and "None" not in err and "Traceback" not in err


# --- one drop bound per variant -----------------------------------------------------------------------------------


def test_every_output_shows_the_gates_drop_bound_and_labels_the_fixed_n_one_descriptive(tiny_runs, tmp_path, capsys):
    run = _copy(tiny_runs, "lossy", tmp_path)
    summary = tmp_path / "summary.md"
    assert _gate(run, tmp_path, KINDS["inconclusive"][1], "--summary", str(summary)) == 2
    console = capsys.readouterr().out
    doc = json.loads((run / "verdict.json").read_text())
    entry = doc["variants"][LOSSY]
    lo, hi = entry["gate"]["checks"]["drop"]["bounds"]
    gate_bound = f"[{lo:+.3f}, {hi:+.3f}]"
    tlo, thi = entry["paired"]["drop_bounds"]
    fixed_n = f"[{tlo:+.3f}, {thi:+.3f}]"
    assert gate_bound != fixed_n  # two different intervals: which one an output calls the drop bound matters

    assert f"{LOSSY}: INCONCLUSIVE, drop {gate_bound} (betting" in console
    assert f"{gate_bound} betting" in summary.read_text()

    assert report_main([str(run), "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    (row,) = [line for line in md.splitlines() if line.startswith(f"| {LOSSY} |")]
    assert f"{gate_bound} | betting" in row and fixed_n not in row
    html = (tmp_path / "report" / "report.html").read_text()
    cell = re.search(r'<td class="num drop-bound">(.*?)</td>', html[html.index(f"<b>{LOSSY}</b>") :], re.S).group(1)
    assert gate_bound in cell and "betting" in cell
    descriptive = re.search(r'<td class="num muted descriptive">(.*?)</td>', html[html.index(f"<b>{LOSSY}</b>") :])
    assert fixed_n in descriptive.group(1) and "descriptive" in descriptive.group(1)
    assert "the gate&#39;s drop bounds, betting" in html or "the gate's drop bounds, betting" in html  # the bars

    fields = verdict_fields(doc, LOSSY)  # what --wandb and logger=wandb write to the variant's W&B run
    assert (fields["drop_lower"], fields["drop_upper"], fields["drop_bound_method"]) == (lo, hi, "betting")


# --- report.html shows the console's labels -----------------------------------------------------------------------


def test_report_html_says_a_pass_is_at_loosened_thresholds_and_on_an_unfinished_run(tiny_runs, tmp_path, capsys):
    run = _copy(tiny_runs, "lossless", tmp_path)
    rows = (run / "samples.jsonl").read_text().splitlines()
    last = json.loads(rows[-1])["sample_id"]
    (run / "samples.jsonl").write_text(
        "".join(line + "\n" for line in rows if json.loads(line)["sample_id"] != last)
    )  # a killed run: fewer samples than run.json drew
    assert _gate(run, tmp_path, KINDS["pass"][1] + "allow_partial: true\n") == 0
    console = capsys.readouterr().out
    assert "PASS at thresholds other than the defaults" in console and "unfinished" in console
    assert report_main([str(run), "--out", str(tmp_path / "report")]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    notes = html[html.index('id="verdict-notes"') :]
    notes = notes[: notes.index("</ul>")]
    assert "thresholds other than the defaults" in notes and "max_drop" in notes and "unfinished" in notes
    assert "PASS at thresholds other than the defaults" in html


# --- verdict.json shown only as the gate wrote it ---------------------------------------------------------------


def test_an_edited_verdict_json_is_shown_by_neither_report_nor_planner(tiny_runs, tmp_path):
    run = _copy(tiny_runs, "lossy", tmp_path)
    assert _gate(run, tmp_path, KINDS["inconclusive"][1]) == 2
    # positive control: the gate's own verdict.json is shown as it is, by both
    assert report_main([str(run), "--out", str(tmp_path / "r1")]) == 0
    assert '"verdict-status" class="badge INCONCLUSIVE">INCONCLUSIVE<' in (tmp_path / "r1" / "report.html").read_text()
    assert {m["status"] for m in measured_variants([run])} == {"INCONCLUSIVE"}
    # PASS written over it, its reasons emptied: the digest still matches the rows, the last look does not
    doc = json.loads((run / "verdict.json").read_text())
    (run / "verdict.json").write_text(json.dumps({**doc, "verdict": "PASS", "reasons": []}))
    assert report_main([str(run), "--out", str(tmp_path / "r2")]) == 0
    html = (tmp_path / "r2" / "report.html").read_text()
    assert '"verdict-status" class="badge NO-VERDICT">NO VERDICT<' in html and "written by the gate" not in html
    assert "is not what the gate decided at its last look" in html
    [m] = measured_variants([run])
    assert m["status"] == "NO VERDICT" and "is not what the gate decided at its last look" in m["why"]
    # the reasons alone edited (the status kept) is not the gate's either
    (run / "verdict.json").write_text(json.dumps({**doc, "reasons": doc["reasons"][:-1]}))
    assert measured_variants([run])[0]["status"] == "NO VERDICT"


def test_looks_run_1_2_3_with_no_gap_or_repeat(tiny_runs, tmp_path, capsys):
    """A gap (1, 3: once accepted), a first look of 10**30 or 2 (once "look 1000...001 of this run"), a repeat: each
    is an edited looks.jsonl, CANNOT JUDGE naming its line, and the planner shows the gate's CANNOT JUDGE."""
    run = _copy(tiny_runs, "lossy", tmp_path)
    assert _gate(run, tmp_path, KINDS["inconclusive"][1]) == 2
    record = json.loads((run / LOOKS_FILE).read_text())
    assert record["look"] == 1
    for numbers, line, why in (
        ((1, 3), 2, "look 3 follows look 1"),
        ((10**30,), 1, "follows look 0"),
        ((2,), 1, "look 2 follows look 0"),
        ((1, 1), 2, "look 1 follows look 1"),
    ):
        (run / LOOKS_FILE).write_text("".join(json.dumps({**record, "look": n}) + "\n" for n in numbers))
        assert _gate(run, tmp_path, KINDS["inconclusive"][1]) == 2
        doc = json.loads((run / "verdict.json").read_text())
        assert doc["verdict"] == "CANNOT JUDGE", numbers
        assert doc["reasons"][0].startswith(f"{run / LOOKS_FILE}:{line}: look record") and why in doc["reasons"][0]
        assert "Traceback" not in capsys.readouterr().err
        assert measured_variants([run])[0]["status"] == "CANNOT JUDGE"  # the planner too: not the INCONCLUSIVE


def test_folders_judged_together_each_number_their_own_looks(tiny_runs, tmp_path):
    """A folder judged twice alone, then beside a fresh one: each folder's looks.jsonl runs 1, 2, 3 (the fresh one
    got the joint look's number, 3, and read as a gap), and judging the two again is not CANNOT JUDGE."""
    a, b = _copy(tiny_runs, "lossy", tmp_path), _copy(tiny_runs, "lossless", tmp_path)
    base = WIDE + "min_baseline_accuracy: null\n"
    assert _gate(a, tmp_path, base) == 0
    assert _gate(a, tmp_path, base.replace("flip_rate: 0.5", "flip_rate: 0.6")) == 0  # other thresholds: a new look
    gate_file = tmp_path / "gate.yaml"
    gate_file.write_text("name: x\n" + base.replace("flip_rate: 0.5", "flip_rate: 0.7"))
    assert gate_main([str(a), str(b), "--gate", str(gate_file), "--out", str(tmp_path / "v")]) == 0

    def numbers(run: Path) -> list[int]:
        return [json.loads(x)["look"] for x in (run / LOOKS_FILE).read_text().splitlines()]

    assert numbers(a) == [1, 2, 3] and numbers(b) == [1]
    gate_file.write_text("name: x\n" + base.replace("flip_rate: 0.5", "flip_rate: 0.8"))
    assert gate_main([str(a), str(b), "--gate", str(gate_file), "--out", str(tmp_path / "v")]) == 0
    assert numbers(a) == [1, 2, 3, 4] and numbers(b) == [1, 2]


# --- the KL cap the gate file states ----------------------------------------------------------------------------


def test_the_gate_file_states_the_kl_cap_the_code_applies():
    lines = (ROOT / "conf" / "gate" / "default.yaml").read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("max_mean_kl:")]  # it said "capped at 10x this"
    assert int(re.search(r"capped at (\d+)x", line).group(1)) == KL_CAP_FACTOR
