"""Inputs that crashed the gate, the report or the planner with a traceback (exit 3, issue 50's 21 cases), each now
refused in one line that names the field and the fix (exit 2), or judged. Record cases start from real tiny-random
run folders, copied and broken in one way; the positive controls judge the same folders unbroken (a lossless variant
PASSes, a lossy one FAILs). A verdict.json written on the way validates against docs/verdict.schema.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from omegaconf import OmegaConf

from evalkit.cli import sweep
from evalkit.cli.gate import main as gate_main
from evalkit.cli.plan import main as plan_main
from evalkit.gate.power import judged_once_lossless
from evalkit.report import build as report_module
from evalkit.report.__main__ import main as report_main
from evalkit.thresholds import Thresholds
from evalkit.tracking import has_credentials
from tests.conftest import ROOT, compose_config, run_cli
from tests.test_machine_outputs import make_tiny_runs

VERDICT_SCHEMA = jsonschema.Draft202012Validator(json.loads((ROOT / "docs" / "verdict.schema.json").read_text()))
# The random model scores 0 everywhere: the baseline check is off. PASS: a lossless variant at wide margins; FAIL:
# compression asked and min_compression 0.01, which a quarter of the cache is over (tests/test_machine_outputs.py).
WIDE = "max_drop: 0.5\nmax_flip_rate: 0.5\nmax_mean_kl: null\nmin_cell_accuracy: null\nmin_samples: 1\n"
PASSING = WIDE + "min_baseline_accuracy: null\n"
FAILING = "min_compression: 0.01\nmin_baseline_accuracy: null\n"
DEEP = "[" * 100_000 + "]" * 100_000  # one line nested 100,000 deep: Python's parser raises RecursionError
HUGE = "1" + "0" * 400  # 401 digits: math.isfinite and float() raise OverflowError


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Real runs of the tiny random model on a small needle grid, judged by no gate: one with a lossless variant
    (every token kept), one with a variant that keeps a quarter of the cache (test_machine_outputs' runs)."""
    return make_tiny_runs(tmp_path_factory.mktemp("inputs"))


def copied(runs: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs[name], tmp_path / name))


def gate_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gate.yaml"
    path.write_text(text)
    return path


def call(capsys, main, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code: int, out: str, err: str, *fragments: str) -> str:
    """The exit-2 contract: one line on stderr, `evalkit: error: ...`, holding each fragment; no traceback."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("evalkit: error: "), (code, out, err)
    assert "Traceback" not in out + err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def cannot_judge(folder: Path, *fragments: str) -> dict:
    """The verdict.json the gate wrote: CANNOT JUDGE, valid against the schema, a reason holding each fragment."""
    verdict = json.loads((folder / "verdict.json").read_text())
    VERDICT_SCHEMA.validate(verdict)
    assert verdict["verdict"] == "CANNOT JUDGE", verdict
    for fragment in fragments:
        assert any(fragment in r for r in verdict["reasons"]), verdict["reasons"]
    return verdict


def edit_info(folder: Path, **changes) -> None:
    """run.json with `changes`, each `a__b=v` setting info[a][b] = v."""
    info = json.loads((folder / "run.json").read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = info
        for key in parents:
            node = node[key]
        node[last] = value
    (folder / "run.json").write_text(json.dumps(info))


# --- positive controls ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "thresholds", "code", "status"), [("lossless", PASSING, 0, "PASS"),
                                                                     ("lossy", FAILING, 1, "FAIL")])  # fmt: skip
def test_positive_controls_the_unbroken_runs_pass_and_fail(runs, tmp_path, capsys, name, thresholds, code, status):
    d = copied(runs, name, tmp_path)
    got, out, err = call(capsys, gate_main, d, "--gate", gate_file(tmp_path, thresholds))
    assert got == code and f"evalkit gate: {status}" in out, (out, err)
    VERDICT_SCHEMA.validate(json.loads((d / "verdict.json").read_text()))


# --- the gate file ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        # ZeroDivisionError (--plan and judging: the random model's baseline check off, so that the drop is judged):
        # no bound lies below a margin of 0
        (
            "max_drop: 0\nmin_baseline_accuracy: null\n",
            "gate.max_drop=0: give a number in (0, 1), e.g. 0.05, or null to switch the check off",
        ),
        # math domain error: every drop is at most 1
        ("max_drop: 1.0\nmin_baseline_accuracy: null\n", "gate.max_drop=1.0: give a number in (0, 1), e.g. 0.05"),
        # OverflowError
        (f"min_samples: {HUGE}\n", "gate.min_samples=10000000000"),
        (f"capacity:\n  gpu_gib: {HUGE}\n  context: 32768\n", "gate.capacity={'gpu_gib': 1000000"),
        # TypeError sorting an int against a str
        ("1: 0.5\nfoo: 2\n", "unknown thresholds 'foo', 1"),
    ],
    ids=["max_drop-0", "max_drop-1", "min_samples-401-digits", "gpu_gib-401-digits", "keys-1-and-foo"],
)
def test_a_gate_file_that_crashed_is_one_line_when_judging_and_planning(runs, tmp_path, capsys, yaml, message):
    path = gate_file(tmp_path, yaml)
    d = copied(runs, "lossless", tmp_path)
    one_line(*call(capsys, gate_main, d, "--gate", path), message)
    one_line(*call(capsys, gate_main, "--plan", "--gate", path), message)
    assert not (d / "verdict.json").exists()  # refused before anything is judged


def test_the_ranges_say_what_they_refuse(tmp_path, capsys):
    code, out, err = call(capsys, gate_main, "--plan", "--gate", gate_file(tmp_path, f"min_samples: {HUGE}\n"))
    line = one_line(code, out, err, "give a whole number in [1, 1e+09]")
    assert len(line) < 200  # the 401 digits are cut, not printed in full
    code, out, err = call(capsys, gate_main, "--plan", "--gate", gate_file(tmp_path, "capacity: {gpu_gib: 1e308}\n"))
    one_line(code, out, err, "gpu_gib in (0, 1e+06] and context in (0, 1e+09]")


# --- run.json, samples.jsonl, looks.jsonl --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model__name": []}, "model.name is [], not a string"),  # TypeError: unhashable type: 'list'
        ({"model__name": 5}, "model.name is 5, not a string"),  # an INCONCLUSIVE verdict.json the schema refused
    ],
    ids=["model-name-list", "model-name-number"],
)
def test_a_run_json_field_of_another_kind_cannot_be_judged(runs, tmp_path, capsys, change, message):
    d = copied(runs, "lossless", tmp_path)
    edit_info(d, **change)
    one_line(*call(capsys, gate_main, d, "--gate", gate_file(tmp_path, PASSING)), "the gate cannot judge", message)
    cannot_judge(d, message)


def test_data_files_that_are_not_digests_in_one_of_two_runs(runs, tmp_path, capsys):
    a, b = copied(runs, "lossless", tmp_path), copied(runs, "lossy", tmp_path)
    edit_info(b, data__files={"x": 1, "y": "abc"})  # TypeError sorting 1 against "abc"
    message = "data.files is {'x': 1, 'y': 'abc'}, not an object, a digest per input file"
    code, out, err = call(capsys, gate_main, a, b, "--gate", gate_file(tmp_path, PASSING))
    one_line(code, out, err, "the gate cannot judge", message)
    cannot_judge(a, message)


@pytest.mark.parametrize("file", ["samples.jsonl", "run.json", "looks.jsonl"])
def test_a_line_nested_100000_deep_cannot_be_judged(runs, tmp_path, capsys, file):
    d = copied(runs, "lossless", tmp_path)
    assert call(capsys, gate_main, d, "--gate", gate_file(tmp_path, PASSING))[0] == 0  # looks.jsonl now has a look
    path = d / file
    lines = path.read_text().splitlines()
    n = len(lines) + 1 if file != "run.json" else 1
    path.write_text(DEEP + "\n" if file == "run.json" else "\n".join([*lines, DEEP]) + "\n")
    code, out, err = call(capsys, gate_main, d, "--gate", gate_file(tmp_path, PASSING))
    where = {
        "samples.jsonl": f"{path}:{n}: line {n} is not valid JSON (nested deeper than 64 levels)",
        "run.json": f"{path}: not valid JSON (nested deeper than 64 levels, line 1)",
        "looks.jsonl": f"{path}:{n}: look record is not a JSON object",
    }[file]
    one_line(code, out, err, "the gate cannot judge", where)
    cannot_judge(d, where)


# --- the report -----------------------------------------------------------------------------------------------------


def test_the_report_of_a_verdict_with_an_overflowing_threshold_shows_no_verdict(runs, tmp_path, capsys):
    d = copied(runs, "lossless", tmp_path)
    assert call(capsys, gate_main, d, "--gate", gate_file(tmp_path, PASSING))[0] == 0
    doc = json.loads((d / "verdict.json").read_text())
    doc["thresholds"]["min_samples"] = 10**400  # OverflowError in math.isfinite
    (d / "verdict.json").write_text(json.dumps(doc))
    code, out, err = call(capsys, report_main, d)
    assert code == 0 and "Traceback" not in out + err, (out, err)
    page = (d / "report" / "report.html").read_text()
    assert "no verdict for these rows" in page and "its thresholds cannot be read" in page


JSONL = [
    {"id": "a", "context": "The code is 731. " * 8, "question": "What is the code?", "answers": ["731"],
     "meta": {"context_length": 64, "depth": "deep"}},
    {"id": "b", "context": "The key is 42. " * 8, "question": "What is the key?", "answers": ["42"],
     "meta": {"context_length": 64, "depth": 0.5}},
]  # fmt: skip


def test_a_string_depth_from_a_jsonl_meta_is_drawn_by_the_run_with_wandb_and_the_report(tmp_path, monkeypatch):
    """A JSONL's meta is the rows' cell: `depth: "deep"` beside a numeric depth killed the run at its W&B report
    (the heatmap formatted "deep" as a number) after the rows were written, and `python -m evalkit.report` too."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in JSONL))
    d = tmp_path / "run"
    r = run_cli(
        "model=tiny-random", "task=jsonl", f"task.path={data}", "task.max_new_tokens=4", "variants=[streaming_llm@0.5]",
        "logger=wandb", "logger.mode=offline", f"hydra.run.dir={d}", env={"WANDB_SILENT": "true"},
    )  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (d / "report" / "heatmaps.png").exists()
    assert report_main([str(d), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "heatmaps.png").exists()


# --- a sweep's exit code is the gate's ------------------------------------------------------------------------------


def sweep_of(runs: dict[str, Path], tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    shutil.copytree(runs["lossless"], root / "needle" / "tiny" / "streaming_llm")
    return root


def merge(root: Path, thresholds: str) -> int | None:
    gate_node = OmegaConf.merge(compose_config("gate=default").gate, OmegaConf.create(thresholds))
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(root)}}, "gate": gate_node})
    return sweep.merge(cfg)


def test_a_sweep_that_passes_exits_0_even_when_its_merged_report_breaks(runs, tmp_path, capsys, monkeypatch):
    """The sweep printed the gate's PASS, then exited 3 because the merged report crashed: the report is said to
    have failed (a bug, with its traceback), and the exit code stays the gate's."""
    root = sweep_of(runs, tmp_path)
    assert merge(root, PASSING) == 0  # the positive control: PASS, and its report
    assert "evalkit gate: PASS" in capsys.readouterr().out and (root / "report" / "report.md").exists()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the report")

    monkeypatch.setattr(report_module, "summarize", broken)
    assert merge(root, PASSING) == 0
    out, err = capsys.readouterr()
    assert "evalkit gate: PASS" in out and "a bug in the report" in err and "internal error" in err
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(root)}}, "gate": {"name": "none"}})
    assert sweep.merge(cfg) == 3  # no gate ran: the bug is the command's outcome


# --- W&B online without credentials ---------------------------------------------------------------------------------


def test_wandb_online_without_an_api_key_is_refused_before_the_first_sample(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no `wandb login` on this machine
    d = tmp_path / "run"
    r = run_cli("model=tiny-random", "task.context_lengths=[96]", "task.depths=[0.5]", "logger=wandb",
                "logger.mode=online", f"hydra.run.dir={d}")  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("evalkit: error: logger.mode=online but no W&B API key is set"), lines
    assert not (d / "samples.jsonl").exists()  # before the first sample
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))  # what `wandb login` writes is a key
    assert has_credentials()
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert has_credentials()


# --- the planner ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([f"plan.batch={HUGE}"], "plan.batch=10000000000"),  # OverflowError
        (["plan.gpu_gib=1e308"], "plan.gpu_gib=1e+308: give a number in (0, 1e+06], e.g. plan.gpu_gib=80"),
        (["plan.context=1000000000000000", "plan.p95_context=1000000000000000"],
         "plan.context=1000000000000000: give a whole number in (0, 1e+08], e.g. plan.context=8192"),
        (["plan.weights_gib=1e308"], "plan.weights_gib=1e+308: give a number in (0, 1e+06], e.g. plan.weights_gib=16"),
    ],
    ids=["batch-401-digits", "gpu_gib-1e308", "context-1e15", "weights_gib-1e308"],
)  # fmt: skip
def test_planner_values_that_crashed_are_one_line(tmp_path, capsys, overrides, message):
    code, out, err = call(capsys, plan_main, "model=tiny-random", *overrides, f"plan.out={tmp_path / 'plan'}")
    one_line(code, out, err, message)
    assert not (tmp_path / "plan").exists()


def test_the_planner_still_plans_at_its_largest_values(tmp_path, capsys):
    """The positive control: the ranges' ends themselves plan (exit 0)."""
    code, out, err = call(
        capsys, plan_main, "model=tiny-random", "plan.gpu_gib=1e6", "plan.batch=1000000", "plan.context=100000000",
        "plan.p95_context=100000000", "plan.weights_gib=1e6", f"plan.out={tmp_path / 'plan'}",
    )  # fmt: skip
    assert code == 0 and "Traceback" not in err, (out, err)


# --- CI outputs -----------------------------------------------------------------------------------------------------


def test_a_summary_that_cannot_be_written_names_its_path(runs, tmp_path, capsys):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    d = copied(runs, "lossless", tmp_path)
    code, out, err = call(capsys, gate_main, d, "--gate", gate_file(tmp_path, PASSING), "--summary", "/dev/full")
    one_line(code, out, err, "could not write /dev/full (No space left on device)")


# --- found by tests/test_gate_fuzz.py -------------------------------------------------------------------------------


def test_a_margin_below_float_resolution_is_planned_not_divided_by_zero():
    """max_drop: 1e-300 is in range, but 1 - 1e-300 is 1.0 in floats: the planner's statement of what a single test
    would need divided by log(1.0) = 0 (ZeroDivisionError, exit 3, in `--plan`)."""
    # by hand: (1 - 0.05)^59 = 0.0485 <= 0.05 < 0.0510 = (1 - 0.05)^58
    assert judged_once_lossless(Thresholds(max_drop=0.05)) == 59
    # log(0.05) / log(1 - 1e-300) = 2.9957 / 1e-300
    assert 2.99e300 < judged_once_lossless(Thresholds(max_drop=1e-300)) < 3.0e300


def test_a_min_samples_beyond_the_planners_reach_is_planned_without_enumerating_it(tmp_path, capsys):
    """min_samples: 1000000000 is in range; `--plan` enumerated the outcomes of a billion contexts (23 GB, killed by
    the kernel) before saying what its own docstring says past 20,000 contexts: no PASS in reach."""
    path = gate_file(tmp_path, "min_samples: 1000000000\n")
    code, out, err = call(capsys, gate_main, "--plan", "--gate", path)
    assert code == 0 and "Traceback" not in err, err
    assert "no PASS in reach" in out and "gate.min_samples: 1000000000" in out
