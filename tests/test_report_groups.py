"""Runs of two engines merged: SmolLM2 on evalkit's own engine (hf) and on llama.cpp, one task, one model.

Each engine ran its own full-cache baseline, so the gate and the report keep their variants apart: a variant's name is
an opaque string (llama.cpp's `llamacpp:q8_0/q4_0` is one name, not a run `llamacpp:q8_0` and a variant `q4_0`), and
each (task, model, backend) has its own Pareto front and its own accuracy floor, named once.
"""

from __future__ import annotations

import html
import json
import re
from collections import defaultdict

import pytest

from evalkit.cli.gate import main as gate_main
from evalkit.records import BASELINE
from evalkit.report.__main__ import main as report_main
from evalkit.report.page import pareto
from tests.conftest import LLAMACPP, NEEDS_LLAMA, run_cli
from tests.test_report_page import read_page, texts

pytestmark = [pytest.mark.real_model, NEEDS_LLAMA]

NEEDLE = ["task=needle", "task.context_lengths=[256]", "task.depths=[0.5]", "task.samples_per_cell=1"]
LLAMA = "llamacpp:q8_0/q4_0"  # llama.cpp's keys in q8_0, values in q4_0: its own name, `/` and `:` included
HF = ("snapkv@0.5+int8", "streaming_llm@0.25")
# evalkit's engine names its variants policy@budget+quant; a name as another engine or a user's config may write it,
# with `=`, `/`, `:` and characters HTML reads as markup, is given to one of them in its run's files
RENAMED = "snapkv@0.5+int8:k=v/<2>"
NAMES = {LLAMA, RENAMED, HF[1]}
GROUPS = {"hf": "needle · smollm2-135m · hf", "llamacpp": "needle · smollm2-135m · llamacpp"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two runs (hf first) judged together by the gate (its verdict.json and step summary), and their report."""
    root = tmp_path_factory.mktemp("engines")
    hf, llama = root / "hf", root / "llamacpp"
    result = run_cli("model=smollm2-135m", f"variants=[{','.join(HF)}]", *NEEDLE, f"hydra.run.dir={hf}")
    assert result.returncode == 0, result.stderr[-2000:]
    # a process of its own: llama.cpp silences its logs by redirecting the process's file descriptors 1 and 2
    result = run_cli(*LLAMACPP, f"variants=[{LLAMA}]", *NEEDLE, f"hydra.run.dir={llama}", process=True)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("samples.jsonl", "run.json"):
        (hf / name).write_text((hf / name).read_text().replace(HF[0], RENAMED))
    # judged once by the gate (verdict.json in the first run's folder, which the report then shows)
    assert gate_main([str(hf), str(llama), "--summary", str(root / "summary.md")]) in (0, 1, 2)
    assert report_main([str(hf), str(llama), "--out", str(root / "report")]) == 0
    return json.loads((hf / "verdict.json").read_text()), root / "report", root / "summary.md"


def test_the_gate_keeps_each_name_whole_with_its_run(runs):
    verdict, _, summary = runs
    variants = verdict["variants"]
    policies = {k for k, v in variants.items() if v["variant"] != BASELINE}
    assert policies == NAMES
    for name in NAMES:
        backend = "llamacpp" if name == LLAMA else "hf"
        assert variants[name]["variant"] == name
        assert variants[name]["run"] == {"task": "needle", "model": "smollm2-135m", "backend": backend}
    baselines = {k: v["run"]["backend"] for k, v in variants.items() if v["variant"] == BASELINE}
    assert sorted(baselines.values()) == ["hf", "llamacpp"]  # two engines: two baselines, never one measurement
    text = summary.read_text()
    assert all(f"`{name}`" in text for name in NAMES) and not any(f"`{b}`" in text for b in baselines)


def test_the_page_shows_each_name_whole_and_escaped_in_tables_legend_and_grids(runs):
    _, report, _ = runs
    page = read_page(report / "report.html")
    shown = {texts(r)[1]: texts(r)[0] for r in page.tables["variant-table"][1:]}
    for name in NAMES:
        assert shown[name] == GROUPS["llamacpp" if name == LLAMA else "hf"]  # the name whole, beside its group
    text = (report / "report.html").read_text()
    assert "&lt;2&gt;" in text and "<2>" not in text  # escaped wherever the page writes it
    panels = {html.unescape(h) for h in re.findall(r"<h4>(.*?)</h4>", text)}
    assert NAMES <= panels  # each variant's cells grid is titled by its whole name
    legend = {html.unescape(t["name"]) for t in page.figures["tradeoff-plot"]["data"] if t["mode"] == "markers"}
    assert NAMES <= legend and not {"q4_0", "llamacpp:q8_0"} & legend
    assert {r["attrs"]["data-variant"] for r in page.tables["lost-table"][1:]} <= NAMES
    md = (report / "report.md").read_text()
    assert all(f"| {name} |" in md for name in NAMES)


def test_each_engine_has_its_own_front_and_floor_named_once(runs):
    verdict, report, _ = runs
    figure = read_page(report / "report.html").figures["tradeoff-plot"]
    markers = [t for t in figure["data"] if t["mode"] == "markers"]
    titles = {json.dumps(t["legendgroup"]): t["legendgrouptitle"]["text"] for t in markers}
    assert set(titles.values()) == set(GROUPS.values())  # the legend groups the markers by (task, model, backend)
    # each group's front, from the gate's own numbers: through that group's variants only
    points: dict[str, list] = defaultdict(list)
    for name, v in verdict["variants"].items():
        points[GROUPS[v["run"]["backend"]]].append((1 - v["kv_ratio"], v["accuracy"], name))
    expected = {g: [(round(x, 9), round(y, 9)) for x, y, _ in pareto(p)] for g, p in points.items()}
    fronts = {
        titles[json.dumps(t["legendgroup"])]: [(round(x, 9), round(y, 9)) for x, y in zip(t["x"], t["y"], strict=True)]
        for t in figure["data"]
        if t["name"] == "Pareto front"
    }
    assert fronts == {g: f for g, f in expected.items() if len(f) > 1}
    floors = [a["text"] for a in figure["layout"]["annotations"] if a["text"].startswith("baseline − max_drop")]
    named = [g for text in floors for g in GROUPS.values() if g in text]
    weak = verdict["thresholds"]["min_baseline_accuracy"] or 0
    strong = [
        v["run"]["backend"] for v in verdict["variants"].values() if v["variant"] == BASELINE and v["accuracy"] >= weak
    ]
    assert sorted(named) == sorted(GROUPS[b] for b in strong)  # each judged baseline's group named once
    assert not any("(needle, needle" in text or ", ," in text for text in floors)
