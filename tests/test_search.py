"""The budget search (search.budgets, search.policies): its variants, its errors, one error rate for the whole search
(a fixed sequence within each policy, the level shared across policies), and the run end to end on tiny-random with
its extension in the same folder."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import jsonschema
import numpy as np
import pytest

from evalkit.cli import search
from evalkit.cli.gate import main as gate_main
from evalkit.cli.spec import parts
from evalkit.errors import ConfigError
from evalkit.gate.junit import junit_xml
from evalkit.gate.outputs import verdict_doc
from evalkit.gate.pipeline import step_summary
from evalkit.records.verdict import verdict_fields
from evalkit.report.frontier import search_section
from evalkit.stats import holm
from evalkit.stats.chains import test_chains as chains_test
from evalkit.thresholds import Thresholds
from tests.conftest import ROOT, compose_config, judge_rows, run_cli
from tests.test_gate import rows

# --- the procedure on p-values, against Bretz et al.'s graphical procedure worked by hand --------------------------


def test_chains_of_one_step_are_holm():
    rng = np.random.default_rng(0)
    for _ in range(500):
        p = rng.uniform(0, 0.12, size=int(rng.integers(1, 6)))
        got = [r.rejected == 1 for r in chains_test([[x] for x in p], 0.05, "holm")]
        assert got == list(holm(p, 0.05)), p


def test_a_chain_stops_at_its_first_hypothesis_kept():
    # one chain at the whole level 0.05: 0.01 and 0.04 rejected, 0.2 kept, 0.001 below it never tested
    (r,) = chains_test([[0.01, 0.04, 0.2, 0.001]], 0.05, "holm")
    assert r.rejected == 2
    assert r.levels == [0.05, 0.05, 0.05, 0.0]


def test_a_finished_chain_hands_its_level_on():
    # By hand: two chains start at 0.025 each. A = [0.01, 0.02]: both <= 0.025, A is done and hands 0.025 to B, whose
    # first p 0.04 is > 0.025 but <= 0.05: rejected at 0.05; B's second, 0.06 > 0.05, is kept.
    a, b = chains_test([[0.01, 0.02], [0.04, 0.06]], 0.05, "holm")
    assert (a.rejected, b.rejected) == (2, 1)
    assert a.levels == [0.025, 0.025] and b.levels == [0.05, 0.05]
    # Bonferroni keeps 0.025 for B: its 0.04 is kept; none: every chain at 0.05
    a, b = chains_test([[0.01, 0.02], [0.04, 0.06]], 0.05, "bonferroni")
    assert (a.rejected, b.rejected) == (2, 0)
    a, b = chains_test([[0.01, 0.02], [0.04, 0.06]], 0.05, "none")
    assert (a.rejected, b.rejected) == (2, 1)
    # a NaN (a budget shown to fail on other grounds) stops its chain whatever follows
    (r,) = chains_test([[0.001, math.nan, 0.001]], 0.05, "holm")
    assert r.rejected == 1


# --- the gate on hand-built rows -------------------------------------------------------------------------------------

N = 120


def search_rows(steps: dict[str, list[float]]) -> list[dict]:
    """Paired rows of several variants on the same N samples, the baseline right on every one: `steps` maps a
    variant (`snapkv@0.5`) to its scores; the baseline's rows written once."""
    out, seen = [], False
    for variant, scores in steps.items():
        budget = float(variant.split("@")[1])
        for r in rows([1.0] * N, scores, variant=variant, kv=(round(100 * budget), 100)):
            if r["variant"] == "baseline" and seen:
                continue
            out.append(r)
        seen = True
    return out


LOSSLESS = [1.0] * N
SOME_LOST = [0.0] * 4 + [1.0] * (N - 4)  # 4 of 120 lost: a drop of 0.033, its upper bound over the 0.05 margin
SEARCH = [{"run_id": "r1", "config": {"search": {"budgets": [0.75, 0.5, 0.25]}}}]


def test_a_budget_below_the_first_not_shown_safe_is_never_reported_safe():
    steps = {"snapkv@0.75": LOSSLESS, "snapkv@0.5": SOME_LOST, "snapkv@0.25": LOSSLESS}
    # the control: judged alone, snapkv@0.25 PASSes (120 lossless contexts, 74 needed)
    alone = judge_rows(search_rows({"snapkv@0.25": LOSSLESS}), [], Thresholds())
    assert alone.status == "PASS", alone.reasons
    v = judge_rows(search_rows(steps), SEARCH, Thresholds())
    found = v.search["policies"]["snapkv"]
    assert [s["status"] for s in found["steps"]] == ["PASS", "INCONCLUSIVE", "NOT TESTED"]
    assert found["safe_budget"] == 0.75 and found["first_not_safe"] == "snapkv@0.5"
    assert found["statement"].startswith("snapkv: safe down to 0.75 (0.5 not shown: the drop may be as large as 0.")
    assert found["statement"].endswith("; 0.25 not tested)")
    assert v.variants["snapkv@0.25"]["gate"]["status"] == "INCONCLUSIVE"
    # every policy is safe at a budget: the search PASSes, and the advice is for the next budget down, snapkv@0.5
    assert v.status == "PASS", v.reasons
    assert v.advice is not None and "samples would show it" in v.advice
    # the same rows judged as plain variants (no search): Holm over all three, snapkv@0.25 PASSes on its own
    plain = judge_rows(search_rows(steps), [], Thresholds())
    assert plain.variants["snapkv@0.25"]["gate"]["status"] == "PASS" and plain.search is None


def test_a_policy_shown_to_fail_at_its_largest_budget_fails_the_search():
    lost = [0.0] * 30 + [1.0] * (N - 30)  # a quarter lost: shown over the margin
    v = judge_rows(search_rows({"snapkv@0.75": lost, "snapkv@0.5": LOSSLESS}), SEARCH, Thresholds())
    assert v.status == "FAIL"
    found = v.search["policies"]["snapkv"]
    assert [s["status"] for s in found["steps"]] == ["FAIL", "NOT TESTED"]
    assert found["safe_budget"] is None
    assert found["statement"].startswith("snapkv: safe at no budget searched (0.75 FAIL")
    assert any(r.startswith("snapkv@0.75: accuracy drop") for r in v.reasons)
    # a FAIL is corrected with every variant's checks (not the search's sequence, which orders PASS claims only)
    said = next(r for r in v.reasons if r.startswith("snapkv@0.75: accuracy drop"))
    assert "Holm's correction over 4 claims of a check broken" in said and "at level" not in said


def test_a_failing_budget_below_the_safe_one_does_not_fail_the_search():
    lost = [0.0] * 30 + [1.0] * (N - 30)
    v = judge_rows(search_rows({"snapkv@0.75": LOSSLESS, "snapkv@0.5": lost}), SEARCH, Thresholds())
    assert v.status == "PASS", v.reasons
    found = v.search["policies"]["snapkv"]
    assert [s["status"] for s in found["steps"]] == ["PASS", "FAIL"]
    assert "0.5 FAIL: drop at least" in found["statement"]


def test_runs_of_a_search_and_runs_that_are_not_cannot_be_judged_together():
    rs = search_rows({"snapkv@0.75": LOSSLESS})
    v = judge_rows(rs, [*SEARCH, {"run_id": "r2", "config": {}}], Thresholds())
    assert v.status == "CANNOT JUDGE" and "a budget search is judged on its own" in v.reasons[0]


# --- the command line ------------------------------------------------------------------------------------------------

BASE = ("model=tiny-random", "policy=snapkv", "task.context_lengths=[256]", "task.depths=[0.5]")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["search.budgets=[0.5,256]"], "give fractions (0.25) or token counts (512), not both"),
        (["search.budgets=[0.5,0.5]"], "[0.5] listed more than once"),
        (["search.budgets=[1.5]"], "search.budgets: 1.5 is not a budget"),
        (["search.budgets=0.5"], "search.budgets=0.5 is not a list"),
        (["search.policies=[snapkv]"], "search.policies is given without search.budgets"),
        (["search.budgets=[0.5]", "variants=[h2o@0.5]"], "search.budgets and variants=[...] are both given"),
        (["search.budgets=[0.5]", "search.policies=[snapkv@0.5]"], "names a budget; list policies alone"),
        (["search.budgets=[0.5]", "search.policies=[snapkvv]"], "unknown policy 'snapkvv'"),
    ],
)
def test_a_search_the_command_line_cannot_run_is_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        parts(compose_config(*BASE, *overrides))
    assert message in str(err.value)


def test_the_variants_of_a_search():
    spec = parts(compose_config(*BASE, "search.budgets=[0.35,0.75,0.5]", "policy.window=16"))
    assert [v.name for v in spec.variants] == ["snapkv@0.75", "snapkv@0.5", "snapkv@0.35"]
    assert {v.policy.window for v in spec.variants} == {16}  # `policy` as configured, its settings kept
    listed = parts(
        compose_config(*BASE, "search.budgets=[512,256]", "search.policies=[streaming_llm,snapkv+int8,int4]")
    )
    assert [v.name for v in listed.variants] == [
        "streaming_llm@512",
        "streaming_llm@256",
        "snapkv@512+int8",
        "snapkv@256+int8",
        "none@1.0+int4",
    ]
    assert search.budgets(compose_config(*BASE)) == []


WIDE = "name: wide\nmin_baseline_accuracy: null\nmin_cell_accuracy: null\nmin_samples: 1\nmax_drop: 0.5\n"


def test_a_search_runs_end_to_end_and_extends_in_its_folder(tmp_path, capsys):
    folder, gate = tmp_path / "run", tmp_path / "wide.yaml"
    gate.write_text(WIDE)
    common = [*BASE, "search.budgets=[0.75,0.35]", "search.policies=[snapkv,streaming_llm]", "task.max_new_tokens=4"]
    first = run_cli(*common, "task.samples_per_cell=3", "gate=none", f"hydra.run.dir={folder}")
    assert first.returncode == 0, first.stderr[-2000:]
    assert gate_main([str(folder), "--gate", str(gate)]) in (0, 2)
    assert "budget search: fixed sequence within each policy" in capsys.readouterr().out
    doc = json.loads((folder / "verdict.json").read_text())
    jsonschema.validate(doc, json.loads((ROOT / "docs" / "verdict.schema.json").read_text()))
    assert list(doc["search"]["policies"]) == ["snapkv", "streaming_llm"]
    assert [s["budget"] for s in doc["search"]["policies"]["snapkv"]["steps"]] == [0.75, 0.35]
    more = run_cli(*common, "task.samples_per_cell=5", "resume=true", "gate=none", f"hydra.run.dir={folder}")
    assert more.returncode == 0, more.stderr[-2000:]
    lines = (folder / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 5 * 5  # five samples, the baseline and four variants each: the first three kept, two added
    assert len({(json.loads(x)["sample_id"], json.loads(x)["variant"]) for x in lines}) == len(lines)
    assert gate_main([str(folder), "--gate", str(gate)]) in (0, 2)
    looks = (folder / "looks.jsonl").read_text().splitlines()
    assert [json.loads(x)["look"] for x in looks] == [1, 2]
    doc = json.loads((folder / "verdict.json").read_text())
    assert {s["n"] for p in doc["search"]["policies"].values() for s in p["steps"]} == {5}


# --- what the CI outputs and W&B say of a search: the gate's decision, in the gate's numbers ------------------------


def search_doc() -> dict:
    """verdict.json of a search that PASSes: snapkv safe down to 0.75, 0.5 not shown, 0.25 not tested though it
    PASSes alone; streaming_llm safe at every budget."""
    steps = {"snapkv@0.75": LOSSLESS, "snapkv@0.5": SOME_LOST, "snapkv@0.25": LOSSLESS}
    steps |= {"streaming_llm@0.75": LOSSLESS, "streaming_llm@0.5": LOSSLESS}
    t = Thresholds()
    return verdict_doc(judge_rows(search_rows(steps), SEARCH, t), t)


def test_the_search_is_in_verdict_json_as_its_schema_says():
    doc = search_doc()
    schema = json.loads((ROOT / "docs" / "verdict.schema.json").read_text())
    jsonschema.validate(json.loads(json.dumps(doc, allow_nan=False)), schema)
    assert doc["search"]["policies"]["streaming_llm"]["safe_budget"] == 0.5
    broken = json.loads(json.dumps(doc))
    broken["search"]["policies"]["snapkv"]["steps"][0]["status"] = "SAFE"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_junit_fails_on_nothing_a_passing_search_reports_past_its_answer():
    """The search PASSes (exit 0): JUnit has no failure; the budgets past snapkv's answer are skipped with their
    status in the search, and each policy has a `safe_budget` case carrying its statement."""
    doc = search_doc()
    assert doc["verdict"] == "PASS"
    root = ET.fromstring(junit_xml(doc).split("\n", 1)[1])
    suite = root.find("testsuite")
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")
    by_class: dict[str, set] = {}
    for case in suite.iter("testcase"):
        kids = [k.tag for k in case]
        by_class.setdefault(case.get("classname"), set()).update(kids or ["passed"])
    assert by_class["evalkit.snapkv@0_5"] == {"skipped"} and by_class["evalkit.snapkv@0_25"] == {"skipped"}
    assert by_class["evalkit.snapkv@0_75"] == {"passed"} and by_class["evalkit.search.snapkv"] == {"passed"}
    assert int(suite.get("skipped")) == sum(1 for c in suite.iter("testcase") if c.find("skipped") is not None) > 0
    skipped = next(c for c in suite.iter("testcase") if c.get("classname") == "evalkit.snapkv@0_25")
    assert skipped.find("skipped").get("type") == "NOT TESTED"
    safe = next(c for c in suite.iter("testcase") if c.get("classname") == "evalkit.search.streaming_llm")
    assert safe.get("name") == "safe_budget" and safe.find("failure") is None
    # the same policy shown to fail at its largest budget: its safe_budget case fails
    lost = [0.0] * 30 + [1.0] * (N - 30)
    t = Thresholds()
    failed = verdict_doc(judge_rows(search_rows({"snapkv@0.75": lost, "snapkv@0.5": LOSSLESS}), SEARCH, t), t)
    suite = ET.fromstring(junit_xml(failed).split("\n", 1)[1]).find("testsuite")
    case = next(c for c in suite.iter("testcase") if c.get("classname") == "evalkit.search.snapkv")
    assert case.find("failure").get("type") == "FAIL" and "safe at no budget searched" in case.find("failure").text


def test_the_step_summary_and_wandb_carry_each_policys_answer():
    doc = search_doc()
    text = step_summary(doc)
    assert "## How far each policy can compress" in text
    assert "| snapkv | 0.25 | NOT TESTED |" in text
    statement = doc["search"]["policies"]["snapkv"]["statement"]
    assert f"PASS: {statement}" in text
    fields = verdict_fields(doc, "snapkv@0.5")
    assert fields["search/policy"] == "snapkv" and fields["search/safe_budget"] == 0.75
    assert fields["search/step_status"] == "INCONCLUSIVE" and fields["search/statement"] == statement
    safe = next(s for s in doc["search"]["policies"]["snapkv"]["steps"] if s["variant"] == "snapkv@0.75")
    assert fields["search/safe_kv_ratio"] == safe["kv_ratio"] == pytest.approx(0.75)  # rows written at 75 of 100 bytes
    capacity = doc["search"]["policies"]["streaming_llm"]["capacity"]
    assert verdict_fields(doc, "streaming_llm@0.75")["search/sequences"] == capacity["sequences"]
    assert "search/policy" not in verdict_fields(doc, "baseline")


@pytest.mark.parametrize(
    "info",
    [{"search": [1]}, {"search": "x"}, {"search": {"budgets": {"a": 1}}}, {"search": {"budgets": None}}],
)
def test_a_run_json_of_any_shape_does_not_crash_the_search(info):
    """run.json's config as the gate reads it (an object: evalkit.records.reading refuses one that is not), its
    `search` of any shape."""
    v = judge_rows(search_rows({"snapkv@0.75": LOSSLESS}), [{"run_id": "r1", "config": info}], Thresholds())
    assert v.status in ("PASS", "FAIL", "INCONCLUSIVE", "CANNOT JUDGE")


def test_a_page_and_wandb_read_a_hand_edited_search_without_a_crash():
    doc = search_doc()
    doc["search"]["policies"]["snapkv"]["steps"] = ["x", 3, {"variant": "snapkv@0.75"}]
    doc["search"]["policies"]["bad"] = "not an entry"
    section = search_section(doc["search"], {"max_drop": 0.05})
    assert [p["policy"] for p in section["policies"]] == ["snapkv", "streaming_llm"]
    assert verdict_fields(doc, "snapkv@0.75")["search/policy"] == "snapkv"
