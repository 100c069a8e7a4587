"""What pipelines receive. Every JSON file evalkit writes for machines is strict JSON: no NaN or Infinity, which
JSON.parse in a browser or Node and Python's json with a refusing parse_constant reject (a CI step that reads
verdict.json would break). The gate's JUnit XML and step summary say which variant and check failed."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from evalkit.cli.gate import main as gate_main
from evalkit.gate.pipeline import step_summary
from evalkit.records import NOT_FINITE, finite, to_json
from tests.conftest import ROOT, run_cli

VERDICT_SCHEMA = jsonschema.Draft202012Validator(json.loads((ROOT / "docs" / "verdict.schema.json").read_text()))


def strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as JSON.parse does."""

    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_to_json_writes_null_with_the_reason_beside_it():
    doc = {"p": math.nan, "upper": math.inf, "bounds": [0.1, -math.inf], "n": 3, "nested": {"kl": math.nan}}
    out = strict(to_json(doc))
    assert out == {
        "p": None,
        f"p{NOT_FINITE}": "nan",
        "upper": None,
        f"upper{NOT_FINITE}": "inf",
        "bounds": [0.1, None],
        "n": 3,
        "nested": {"kl": None, f"kl{NOT_FINITE}": "nan"},
    }
    assert finite((1.0, 2)) == [1.0, 2]
    with pytest.raises(ValueError):
        strict(json.dumps(doc))  # what the writers did before: "p": NaN


def every_json(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> dict[str, Path]:
    return make_tiny_runs(tmp_path_factory.mktemp("strict"))


def make_tiny_runs(tmp: Path) -> dict[str, Path]:
    """Real runs of the tiny random model on a small needle grid: one with a lossless variant (every token kept), one
    with a variant that keeps a quarter of the cache."""
    out = {}
    for name, variant in (("lossless", "streaming_llm@1.0"), ("lossy", "streaming_llm@0.25")):
        out[name] = tmp / name
        r = run_cli(
            "model=tiny-random",
            "task=needle",
            "task.context_lengths=[96]",
            "task.depths=[0.0,0.5,1.0]",
            "task.samples_per_cell=3",
            "task.max_new_tokens=4",
            f"variants=[{variant}]",
            "gate=none",
            f"hydra.run.dir={out[name]}",
        )
        assert r.returncode == 0, r.stderr[-2000:]
    return out


# The random model scores 0 everywhere, so the baseline check is off (min_baseline_accuracy: null) but where it makes
# the verdict CANNOT JUDGE. PASS: a lossless variant at wide margins; FAIL: compression asked and min_compression
# 0.01 (a quarter of the cache is over 0.01 of it); INCONCLUSIVE: 9 samples at the default margins.
WIDE = "max_drop: 0.5\nmax_flip_rate: 0.5\nmax_mean_kl: null\nmin_cell_accuracy: null\nmin_samples: 1\n"
KINDS = {
    "pass": ("lossless", WIDE + "min_baseline_accuracy: null\n", 0, "PASS"),
    "fail": ("lossy", "min_compression: 0.01\nmin_baseline_accuracy: null\n", 1, "FAIL"),
    "inconclusive": ("lossy", "min_baseline_accuracy: null\n", 2, "INCONCLUSIVE"),
    "cannot-judge": ("lossy", "min_baseline_accuracy: 1.0\n", 2, "CANNOT JUDGE"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_file_of_a_judged_run_parses_strictly(tiny_runs, tmp_path, kind):
    run, thresholds, code, status = KINDS[kind]
    gate_file = tmp_path / "gate.yaml"
    gate_file.write_text(f"name: {kind}\n{thresholds}")
    out = tmp_path / "verdict"
    assert gate_main([str(tiny_runs[run]), "--gate", str(gate_file), "--out", str(out)]) == code
    files = every_json(tiny_runs[run]) + every_json(out)
    assert {p.name for p in files} >= {"run.json", "samples.jsonl", "summary.json", "verdict.json"}
    for path in files:
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        for line in lines:
            strict(line)  # raises on NaN / Infinity
    verdict = strict((out / "verdict.json").read_text())
    assert verdict["verdict"] == status and verdict["schema"] == "evalkit.verdict/1"
    VERDICT_SCHEMA.validate(verdict)  # the published schema describes every kind of verdict


def test_the_verdict_schema_refuses_what_it_does_not_describe(tiny_runs, tmp_path):
    gate_file = tmp_path / "gate.yaml"
    gate_file.write_text("name: x\nmin_baseline_accuracy: null\n")
    gate_main([str(tiny_runs["lossy"]), "--gate", str(gate_file), "--out", str(tmp_path)])
    good = strict((tmp_path / "verdict.json").read_text())
    VERDICT_SCHEMA.validate(good)
    name = next(n for n, v in good["variants"].items() if "gate" in v)
    for edit in (
        lambda d: d.update(verdict="MAYBE"),
        lambda d: d.pop("reasons"),
        lambda d: d.update(extra=1),
        lambda d: d["variants"][name]["gate"]["checks"]["drop"].update(holds="yes"),
        lambda d: d["cells"][0].update(p_not_finite="NaN"),
    ):
        bad = json.loads(json.dumps(good))
        edit(bad)
        with pytest.raises(jsonschema.ValidationError):
            VERDICT_SCHEMA.validate(bad)


def junit_cases(path: Path) -> tuple[ET.Element, dict[tuple[str, str], str]]:
    """The suite element and each case's outcome by (classname, name), checked against JUnit's required fields."""
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    assert {"name", "tests", "failures", "errors", "skipped"} <= set(suite.attrib)
    out = {}
    for case in suite.findall("testcase"):
        assert {"name", "classname"} <= set(case.attrib)
        kids = [k.tag for k in case]
        assert len(kids) <= 1 and set(kids) <= {"failure", "skipped", "error"}
        out[case.get("classname"), case.get("name")] = kids[0] if kids else "passed"
    counts = [sum(v == k for v in out.values()) for k in ("failure", "error", "skipped")]
    assert int(suite.get("tests")) == len(out)
    assert [int(suite.get(k)) for k in ("failures", "errors", "skipped")] == counts
    return suite, out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_junit_has_a_case_per_variant_and_check(tiny_runs, tmp_path, kind):
    run, thresholds, code, status = KINDS[kind]
    gate_file = tmp_path / "gate.yaml"
    gate_file.write_text(f"name: {kind}\n{thresholds}")
    junit, summary = tmp_path / "gate.xml", tmp_path / "summary.md"
    summary.write_text("earlier step\n")  # GitHub's step summary is appended to
    args = [str(tiny_runs[run]), "--gate", str(gate_file), "--out", str(tmp_path / "v")]
    assert gate_main([*args, "--junit", str(junit), "--summary", str(summary)]) == code
    suite, cases = junit_cases(junit)
    variant = {"lossless": "streaming_llm@1.0", "lossy": "streaming_llm@0.25"}[run]
    classname = "evalkit.needle." + variant.replace(".", "_")  # a `.` would split it into packages
    # the verdict's case is named the same whatever its status; nothing short of a PASS is green or skipped
    verdict_case = {"PASS": "passed", "FAIL": "failure", "INCONCLUSIVE": "failure", "CANNOT JUDGE": "error"}[status]
    assert cases[("evalkit", "verdict")] == verdict_case and "skipped" not in cases.values()
    if status == "CANNOT JUDGE":  # nothing was judged: no variant's check is a case
        assert set(cases) == {("evalkit", "verdict")}
    else:
        # the thresholds in KINDS switch on drop and flips (and KL but for PASS): one case each
        checks = {name for (cls, name) in cases if cls == classname}
        assert {"drop", "flips", "compression", "status"} <= checks
        outcomes = {cases[classname, c] for c in ("drop", "flips")}
        # PASS: both shown to hold; INCONCLUSIVE: 9 samples show neither; FAIL: compression, not these checks
        assert outcomes == {"PASS": {"passed"}, "INCONCLUSIVE": {"failure"}, "FAIL": {"failure"}}[status]
        assert cases[classname, "compression"] == ("failure" if status == "FAIL" else "passed")
    text = summary.read_text()
    assert text.startswith("earlier step\n") and f"## evalkit gate: {status}" in text
    if status != "CANNOT JUDGE":
        assert f"| `{variant}` |" in text


def test_step_summary_escapes_variant_names():
    doc = {"verdict": "FAIL", "reasons": ["a|b: x"], "variants": {"llamacpp:q8_0/q4_0|x": {"n": 3, "gate": {}}}}
    text = step_summary(doc)
    assert "| `llamacpp:q8_0/q4_0\\|x` |" in text and "- a\\|b: x" in text
