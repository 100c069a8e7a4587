"""report.html and plan.html as written: the verdict on top, the trade-off, cells, lost samples, runs of several tasks.

The page is read here as HTML (stdlib parser); tests/test_report_browser.py opens it in Chromium.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from evalkit.records.looks import digest
from evalkit.records.reading import read_runs
from evalkit.records.summary import summarize
from evalkit.report.__main__ import main as report_main
from evalkit.report.data import VerdictView
from evalkit.report.page import DODGE, tradeoff_figure
from evalkit.thresholds import thresholds
from tests.conftest import ROOT, as_rows
from tests.test_gate import rows
from tests.test_report import needle_rows, write_run


class Page(HTMLParser):
    """The parts of a page the tests read: text by element id, table rows (cell texts and attributes) by table id,
    and the figures' JSON by target."""

    def __init__(self, text: str):
        super().__init__()
        self.text: dict[str, str] = {}
        self.tables: dict[str, list[dict]] = {}
        self.figures: dict[str, dict] = {}
        self._open: list[tuple[str, str | None]] = []  # (tag, id) of the elements we are inside
        self._table: str | None = None
        self._row: dict | None = None
        self._figure: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "br":
            self.handle_data(" ")
        if tag in ("br", "meta", "input", "img", "link", "hr"):  # void elements: no end tag follows
            return
        self._open.append((tag, a.get("id")))
        if a.get("id"):
            self.text.setdefault(a["id"], "")
        if tag == "table" and a.get("id"):
            self._table = a["id"]
            self.tables[self._table] = []
        if tag == "tr" and self._table:
            self._row = {"attrs": a, "cells": []}
        if tag in ("td", "th") and self._row is not None:
            self._row["cells"].append({"text": "", "attrs": a})
        if tag == "script" and "figure" in (a.get("class") or ""):
            self._figure = a["data-target"]
            self.figures[self._figure] = ""

    def handle_endtag(self, tag):
        while self._open:
            t, _ = self._open.pop()
            if t == tag:
                break
        if tag == "tr" and self._row is not None and self._table:
            self.tables[self._table].append(self._row)
            self._row = None
        if tag == "table" and not any(i == self._table for _, i in self._open):
            self._table = None
        if tag == "script" and self._figure:
            self.figures[self._figure] = json.loads(self.figures[self._figure])
            self._figure = None

    def handle_data(self, data):
        if self._figure:
            self.figures[self._figure] += data
            return
        for _, i in self._open:
            if i:
                self.text[i] += data
        if self._row is not None and self._row["cells"]:
            self._row["cells"][-1]["text"] += data


def texts(row: dict) -> list[str]:
    return [" ".join(c["text"].split()) for c in row["cells"]]


def read_page(path: Path) -> Page:
    return Page(path.read_text())


def lost_by_hand(run: Path) -> set[tuple[str, str]]:
    """(variant, sample id) of every row scoring below its baseline row, read straight from samples.jsonl."""
    recs = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    base = {r["sample_id"]: r["score"] for r in recs if r["variant"] == "baseline"}
    return {(r["variant"], r["sample_id"]) for r in recs if r["score"] < base[r["sample_id"]]}


# --- every lost sample, one click away ------------------------------------------------------------------------------


def test_lost_samples_are_the_rows_below_their_baseline_with_their_line_in_samples_jsonl(tmp_path):
    """needle_rows: streaming_llm@0.25 loses the 4 samples at depth 0.5 (i % 3 == 1) with evidence 0.0 and 0.1 per
    layer (mean 0.05: evicted); snapkv@0.5 loses none. Each lost row links the line that holds it."""
    run = write_run(tmp_path / "run", needle_rows())
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    page = read_page(tmp_path / "out" / "report.html")
    lost = page.tables["lost-table"][1:]
    assert {(r["attrs"]["data-variant"], texts(r)[2].split()[0]) for r in lost} == {
        ("streaming_llm@0.25", str(i)) for i in (1, 4, 7, 10)
    }
    assert lost_by_hand(run) == {("streaming_llm@0.25", str(i)) for i in (1, 4, 7, 10)}
    lines = (run / "samples.jsonl").read_text().splitlines()
    for r in lost:
        cells = texts(r)
        sid = cells[2].split()[0]
        assert r["attrs"]["data-cause"] == "evicted" and "depth=0.5" in r["attrs"]["data-cell"]
        keys = [(json.loads(line)["sample_id"], json.loads(line)["variant"]) for line in lines]
        number = keys.index((sid, "streaming_llm@0.25")) + 1
        assert f"run/samples.jsonl:{number}" in cells[8]
    page_text = (tmp_path / "out" / "report.html").read_text()  # the strip: one coloured span per layer, named
    assert page_text.count('title="layer 0: 0.00, layer 1: 0.10"') == 4
    assert 'href="../run/samples.jsonl"' in page_text
    assert page.text["lost-total"] == "4"


def test_a_row_with_a_context_id_shows_it_beside_the_sample(tmp_path):
    recs = needle_rows()
    for r in recs:
        r["context_id"] = f"ctx-{r['sample_id']}"
    run = write_run(tmp_path / "run", recs)
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    lost = read_page(tmp_path / "out" / "report.html").tables["lost-table"][1:]
    assert all(f"context ctx-{texts(r)[2].split()[0]}" in texts(r)[2] for r in lost) and lost


# --- where it fails -------------------------------------------------------------------------------------------------


def test_a_cell_the_baseline_cannot_do_is_shown_as_such_and_a_cell_shown_to_fail_is_marked(tmp_path):
    """40 samples at depth 0.0, where baseline and policy both score 0: the baseline cannot do the cell, so it is
    drawn hatched as 'base 0.00', never as an accuracy of the policy (nor 0.5); 40 at depth 1.0 where the baseline
    scores 1 and the policy 0: 0/40 is below min_cell_accuracy=0.5 at any confidence (binomial p = 0.5^40)."""
    cell = lambda i: {"context_length": 1024, "depth": 0.0 if i < 40 else 1.0}  # noqa: E731
    recs = rows([0] * 40 + [1] * 40, [0] * 80, "h2o@0.25", cell=cell)
    run = write_run(tmp_path / "run", recs)
    gate_verdict(run, run)  # the page marks the cells the gate's verdict.json shows failing
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.html").read_text()
    policy_panel = text[text.index("<h4>h2o@0.25</h4>") :]
    policy_panel = policy_panel[: policy_panel.index("</table>")]
    cannot, failed = policy_panel.split("<tr><th>")[2], policy_panel.split("<tr><th>")[3]
    assert cannot.startswith("0</th>") and 'class="cannot' in cannot and "base<br>0.00" in cannot
    assert "0.50" not in policy_panel
    assert failed.startswith("1</th>") and "failed" in failed and "0.00<br>" in failed and "n=40" in failed


# --- the verdict on top ---------------------------------------------------------------------------------------------


def test_the_verdict_is_the_gates_verdict_json_for_these_runs_with_its_advice_and_looks(tmp_path):
    """A verdict.json the gate wrote for this run after its last row: its status, reasons, look count and the
    command that extends the run (the gate derives it, tests/test_bad_input.py; the page shows it)."""
    info = {"run_id": "r1", "command": ["/x/evalkit/__main__.py", "task=needle", "task.samples_per_cell=1",
                                        "hydra.run.dir=results/x"]}  # fmt: skip
    run = write_run(tmp_path / "run", needle_rows(), info)
    advice = "at the observed rates, 30 samples would show it: add at least 18, e.g. task.samples_per_cell=5 "
    advice += "resume=true"
    extend = "python -m evalkit task=needle task.samples_per_cell=5 resume=true hydra.run.dir=/r/x"
    doc = {"verdict": "INCONCLUSIVE", "reasons": ["snapkv@0.5: not shown within 0.05"], "advice": advice,
           "extend": extend, "looks": 3, "runs": ["run"], "thresholds": {"max_drop": 0.05, "min_samples": None},
           "not_judged": ["snapkv@0.5: no cell judged (1 samples, a failure here can be shown from 10)",
                          "cell L128-d0.5: the baseline scores 0.20 there, below 0.5"]}  # fmt: skip
    doc["digest"] = digest(read_runs([run]).rows, thresholds(doc["thresholds"], "test"))  # it judged these rows
    (run / "verdict.json").write_text(json.dumps(doc))
    # and its look records that verdict (evalkit.records.shown): looks 1 to 3, the last with its verdict and reasons
    said = {k: doc[k] for k in ("verdict", "reasons", "digest")}
    (run / "looks.jsonl").write_text(
        "".join(json.dumps({"look": n, "thresholds": {}, "variants": {}, **said}) + "\n" for n in (1, 2, 3))
    )
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    page = read_page(tmp_path / "out" / "report.html")
    assert page.text["verdict-status"] == "INCONCLUSIVE" and page.text["verdict-looks"] == "3"
    assert "snapkv@0.5: not shown within 0.05" in page.text["verdict-reasons"]
    assert "add at least 18" in page.text["verdict-advice"]
    assert page.text["extend-command"] == extend  # the gate's (evalkit.gate.judge.extend_command), shown as written
    assert "verdict.json (written by the gate)" in page.text["verdict"]
    # what was not judged, and why, in the gate's words (the page once said "1 cell(s) not judged: the baseline is
    # too weak there" whatever the gate's reasons and count), and min_samples=null as what it means
    assert "2 not judged (the gate's reasons)" in page.text["verdict"] and "too weak" not in page.text["verdict"]
    for reason in doc["not_judged"]:
        assert reason in page.text["verdict"]
    assert "min_samples=auto (the count a lossless PASS needs)" in page.text["thresholds"]


def gate_verdict(run: Path, out: Path, *args: str) -> str:
    """The verdict `python -m evalkit.gate RUN` gives, written elsewhere than the run folder."""
    res = subprocess.run(
        [sys.executable, "-m", "evalkit.gate", str(run), "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode in (0, 1, 2) and (out / "verdict.json").is_file(), res.stderr[-2000:]
    return json.loads((out / "verdict.json").read_text())["verdict"]


def test_a_stale_or_foreign_verdict_json_is_not_shown_and_the_report_does_not_judge(tmp_path):
    """Rows changed after the verdict (resume=true, an edit), or a verdict of other runs: the report shows no verdict
    for these rows and the command that judges them, and why it did not use the file (it never judges itself)."""
    run = write_run(tmp_path / "run", needle_rows())
    assert gate_verdict(run, run) != "PASS"
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert read_page(tmp_path / "out" / "report.html").text["verdict"].count("written by the gate") == 1
    lines = (run / "samples.jsonl").read_text().splitlines()
    (run / "samples.jsonl").write_text("\n".join(lines[:-2]) + "\n")  # the rows changed since the gate judged them
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    page = read_page(tmp_path / "out" / "report.html")
    assert page.text["verdict-status"] == "NO VERDICT" and "judged other rows" in page.text["verdict"]
    assert f"no verdict for these rows: run python -m evalkit.gate {run}" in page.text["verdict-reasons"]

    (run / "verdict.json").write_text(json.dumps({"verdict": "PASS", "runs": [str(tmp_path / "elsewhere")]}))
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    page = read_page(tmp_path / "out" / "report.html")
    assert page.text["verdict-status"] == "NO VERDICT" and "judged other runs" in page.text["verdict"]


# --- the trade-off --------------------------------------------------------------------------------------------------


def test_variants_at_one_point_get_their_own_markers_and_the_front_is_pareto(tmp_path):
    """h2o@0.25 and streaming_llm@0.25 both score 8/12 at 0.25x: two markers DODGE apart around 0.75 saved, each
    naming the other on hover; snapkv@0.5 (12/12 at 0.5x) saves more than the baseline (0, 1.0) at the same
    accuracy, so the front runs from snapkv (0.5, 1.0) to the pair (0.75, 0.667)."""
    recs = needle_rows()
    recs += [{**r, "variant": "h2o@0.25"} for r in recs if r["variant"] == "streaming_llm@0.25"]
    summary = summarize(as_rows(recs))
    view = VerdictView("FAIL", [], {"max_drop": 0.05}, "test")
    fig = tradeoff_figure(summary, view)
    markers = {t.name: t for t in fig.data if t.mode == "markers"}
    assert set(markers) == {"baseline", "h2o@0.25", "snapkv@0.5", "streaming_llm@0.25"}
    xs = sorted(markers[n].x[0] for n in ("h2o@0.25", "streaming_llm@0.25"))
    assert xs == pytest.approx([0.75 - DODGE / 2, 0.75 + DODGE / 2])
    assert "same point: streaming_llm@0.25" in markers["h2o@0.25"].hovertext[0]
    (front,) = [t for t in fig.data if t.name == "Pareto front"]
    assert list(front.x) == pytest.approx([0.5, 0.75, 0.75])
    assert list(front.y) == pytest.approx([1.0, 8 / 12, 8 / 12])


# --- the planner's page, and no torch -------------------------------------------------------------------------------


def test_plan_writes_a_page_with_its_tables_and_an_interactive_pressure_plot(tmp_path):
    """plan.html beside plan.json: every table plan.md has, and the crossover curve of plan.json as a figure."""
    res = subprocess.run(
        [sys.executable, "-m", "evalkit.plan", "model=tiny-random", f"plan.out={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "plan.json").read_text())
    page = read_page(tmp_path / "plan.html")
    md_titles = [line[3:] for line in (tmp_path / "plan.md").read_text().splitlines() if line.startswith("## ")]
    assert len(md_titles) == 5 and all(f"<h2>{t}</h2>" in (tmp_path / "plan.html").read_text() for t in md_titles)
    curve = next(t for t in page.figures["pressure-plot"]["data"] if t.get("name") == "KV bytes = weight bytes")
    cross = sorted((int(b), c) for b, c in doc["pressure"]["crossover"].items() if c is not None)
    assert curve["x"] == [b for b, _ in cross] and curve["y"] == pytest.approx([c for _, c in cross])
    named = " ".join(t.get("name", "") for t in page.figures["pressure-plot"]["data"])
    assert all(point in named for point in doc["pressure"]["points"])


def loads_none(modules: str, unwanted: str) -> None:
    """Importing `modules` in a fresh interpreter loads no module `m` for which the expression `unwanted` holds."""
    code = f"import sys, {modules}; bad = sorted(m for m in sys.modules if {unwanted}); assert not bad, bad"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_report_and_the_planner_load_without_torch():
    loads_none(
        "evalkit.report.build, evalkit.report.__main__, evalkit.report.page, evalkit.report.data, evalkit.html, "
        "evalkit.cli.plan, evalkit.plan.page",
        "m.split('.')[0] in ('torch', 'transformers')",
    )


def test_the_report_and_the_planner_load_nothing_of_the_gate():
    """They read records and the gate's verdict.json through the leaves (evalkit.records.shown, .verdict): before,
    the report imported evalkit.gate.judge to compute the baseline's problems, and the planner gate.decide."""
    loads_none(
        "evalkit.report.build, evalkit.report.__main__, evalkit.report.wandb_log, evalkit.plan.guide, "
        "evalkit.plan.measured, evalkit.plan.outputs",
        "m.startswith('evalkit.gate')",
    )


def test_links_are_relative_paths_and_a_long_prediction_is_shown_cut(tmp_path):
    """A run folder named `javascript:alert(1)` beside the report: before, its lost samples linked
    `href="javascript:alert(1)/samples.jsonl"`, a script the link ran. Now the link is the relative path,
    percent-encoded, and it still leads to the file. One prediction of 3,000,000 characters: before, it was on the page
    twice whole (the cell and the row shown beside it); now each shows its first SHOWN_CHARS = 2000 and its length."""
    from urllib.parse import unquote

    recs = needle_rows()
    lost = next(r for r in recs if r["variant"] == "streaming_llm@0.25" and r["sample_id"] == "1")
    lost["prediction"] = "7" * 2000  # the control: 2000 characters are shown whole
    run = write_run(tmp_path / "plain", recs)
    assert report_main([str(run), "--out", str(tmp_path / "out")]) == 0
    plain = (tmp_path / "out" / "report.html").read_text()
    assert "[cut:" not in plain and plain.count("7" * 2000) == 2
    huge = "7" * 3_000_000
    lost["prediction"] = huge
    results = tmp_path / "results"
    run = write_run(results / "javascript:alert(1)", recs)
    assert report_main([str(run), "--out", str(results)]) == 0
    text = (results / "report.html").read_text()
    hrefs = re.findall(r'<a href="([^"]*)" title="[^"]*">open the file</a>', text)  # each lost sample's row
    assert len(hrefs) == 4 and all(":" not in h for h in hrefs), hrefs
    assert {(results / unquote(h)).resolve() for h in hrefs} == {(run / "samples.jsonl").resolve()}
    assert huge not in text and len(text) - len(plain) < 10_000  # the page with plotly's script is ~5 MB either way
    assert text.count(f"{'7' * 2000}... [cut: 3000000 characters in all]") == 2
