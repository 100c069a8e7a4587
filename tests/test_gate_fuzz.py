"""No input crashes the gate, the report or the planner: property-based tests (Hypothesis) that put JSON values of
every type, size and depth into the fields of real tiny-random run folders (run.json, samples.jsonl, looks.jsonl,
verdict.json), into gate files and into the planner's values.

Invariants: the gate exits 0, 1 or 2, never 3 and never with a traceback; a verdict.json it writes validates against
docs/verdict.schema.json; the report exits 0 or 2 and, in a sweep, never replaces the gate's exit code; the planner
exits 0 or 2. The fields come from the readers themselves (records.checks, gate.evidence, gate.thresholds,
plan.settings, records.looks) and from every path in the real files, so a field a reader accepts is a field mutated.

A fixed budget of derandomized examples (EXAMPLES per property) keeps the file within the suite's time on one core.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from evalkit.cli import sweep
from evalkit.cli.gate import main as gate_main
from evalkit.cli.plan import compose as plan_compose
from evalkit.cli.plan import plan_from
from evalkit.exits import guarded
from evalkit.plan.settings import Settings
from evalkit.records import RunInfo
from evalkit.records.checks import OPTIONAL_BYTES, ROW_FIELDS, SHAPES
from evalkit.records.evidence import HF_FIELDS, KINDS, RUN_NEEDS
from evalkit.records.schema import NAMED
from evalkit.report.__main__ import main as report_main
from evalkit.thresholds import Thresholds
from tests.conftest import ROOT, compose_config, run_cli

VERDICT_SCHEMA = jsonschema.Draft202012Validator(json.loads((ROOT / "docs" / "verdict.schema.json").read_text()))
# Examples per property (derandomized: every run of the suite tries the same inputs); EVALKIT_FUZZ_EXAMPLES=2000
# searches longer
EXAMPLES = int(os.environ.get("EVALKIT_FUZZ_EXAMPLES", "80"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as drawn, within the time budget
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
PASSING = {"max_drop": 0.5, "max_flip_rate": 0.5, "max_mean_kl": None, "min_cell_accuracy": None, "min_samples": 1,
           "min_baseline_accuracy": None}  # fmt: skip

# --- JSON values of any type, size and depth ---------------------------------------------------------------------

SPECIAL = st.sampled_from(
    [0, -1, 1, 10**400, -(10**400), 1e308, -1e308, float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, "",
     "deep", "\x00", "\ud800", "a\x01b", "../..", "baseline", "sha256:0", True, False, None, [], {}]
)  # fmt: skip
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | SPECIAL
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | SPECIAL.filter(
        lambda k: isinstance(k, str)), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


# JSON text nested up to 200,000 deep: a value Python's json cannot even write
DEEP_TEXT = st.integers(1, 200_000).map(lambda n: "[" * n + "]" * n) | st.integers(1, 200_000).map(
    lambda n: '{"a":' * n + "1" + "}" * n
)  # fmt: skip


def dumps(value: Any) -> str:
    """A value as a JSON line (NaN and Infinity as Python writes them: readers must refuse them themselves)."""
    return json.dumps(value)


# --- the real folder the mutations start from ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """A real run of the tiny random model with a lossless and a lossy variant, judged once by the gate at wide
    margins (a PASS: the mutations start from the verdict that claims most), so that it holds a verdict.json and a
    looks.jsonl too."""
    folder = tmp_path_factory.mktemp("fuzz-seed") / "run"
    r = run_cli(
        "model=tiny-random", "task=needle", "task.context_lengths=[96]", "task.depths=[0.0,0.5,1.0]",
        "task.samples_per_cell=3", "task.max_new_tokens=4", "variants=[streaming_llm@1.0,streaming_llm@0.25]",
        "gate=none", f"hydra.run.dir={folder}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert judged(folder, "--gate", str(gate_file(folder.parent, PASSING))) == 0
    assert (folder / "verdict.json").exists() and (folder / "looks.jsonl").exists()
    return folder


def paths(doc: Any, prefix: tuple = (), depth: int = 3) -> list[tuple]:
    """Every key path in `doc` down to `depth` levels (list items by index)."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for key, value in items:
        out.append((*prefix, key))
        if depth > 1:
            out += paths(value, (*prefix, key), depth - 1)
    return out


def put(doc: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    """`doc` with `value` at `path` (or the key deleted); a step that is not an object or list becomes an object."""
    if not path:
        return value
    doc = doc if isinstance(doc, (dict, list)) else {}
    key, rest = path[0], path[1:]
    if isinstance(doc, list):
        if not isinstance(key, int) or not doc:
            return doc
        key %= len(doc)
    if delete and not rest:
        doc.pop(key, None) if isinstance(doc, dict) else doc.pop(key)
        return doc
    doc[key] = put(doc[key] if (isinstance(doc, list) or key in doc) else {}, rest, value, delete)
    return doc


def dotted(names) -> list[tuple]:
    return [tuple(n.split(".")) for n in names]


# The fields each reader accepts, from the readers themselves: run.json (records.evidence's RUN_NEEDS and KINDS,
# records' RunInfo, and what records.sample_identity and the advice read of the config), a row (records.checks'
# ROW_FIELDS, SHAPES and OPTIONAL_BYTES, records.schema's NAMED, records.evidence's HF_FIELDS), a look record
# (records.looks' format), the thresholds (evalkit.thresholds) and the planner's values (plan.settings); every path in
# the real files too
RUN_FIELDS = dotted(
    [k for k, _ in RUN_NEEDS] + [k for k, _, _ in KINDS] + [f.name for f in dataclasses.fields(RunInfo)]
    + ["config.seed", "config.task.samples_per_cell", "config.task.limit", "config.task.fraction",
       "config.task._target_", "config.task.scorer", "config.protocol", "looks"]
)  # fmt: skip
ROW_KEYS = sorted({*ROW_FIELDS, *SHAPES, *OPTIONAL_BYTES, *NAMED, *HF_FIELDS})
LOOK_FIELDS = dotted(["look", "at", "digest", "verdict", "thresholds", "runs", "variants"])
THRESHOLD_KEYS = [f.name for f in dataclasses.fields(Thresholds)] + ["name", "capacity.gpu_gib", "capacity.context"]
PLAN_KEYS = [f.name for f in dataclasses.fields(Settings)]
MUTATION = st.tuples(st.booleans(), VALUES)  # (delete the field, or the value put there)
LINE = DEEP_TEXT | VALUES.map(dumps)  # a whole line (or file) replaced


def quiet(main, argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def judged(folder: Path, *args: str) -> int:
    """The gate on `folder`, in this process: its exit code, with the contract checked (0, 1 or 2, no traceback,
    a verdict.json it wrote valid against the schema)."""
    verdict = folder / "verdict.json"
    before = verdict.stat().st_mtime_ns if verdict.exists() else None
    code, err = quiet(gate_main, [str(folder), *args])
    assert code in (0, 1, 2) and "Traceback" not in err, err[-3000:]
    if verdict.exists() and verdict.stat().st_mtime_ns != before:
        VERDICT_SCHEMA.validate(json.loads(verdict.read_text()))
    return code


def reported(folder: Path) -> int:
    code, err = quiet(report_main, [str(folder), "--out", str(folder / "fuzz-report")])
    assert code in (0, 2) and "Traceback" not in err, err[-3000:]
    return code


def gate_file(where: Path, values: Any) -> Path:
    path = where / "gate.yaml"
    path.write_text(yaml.safe_dump(values, allow_unicode=True))
    return path


@contextlib.contextmanager
def copy_of(seed: Path):
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(shutil.copytree(seed, Path(tmp) / "run"))


def mutated_json(doc: Any, fields: list[tuple], data) -> Any:
    """`doc` with one to three of `fields` set to any JSON value or deleted."""
    for _ in range(data.draw(st.integers(1, 3))):
        delete, value = data.draw(MUTATION)
        doc = put(doc, data.draw(st.sampled_from(fields)), value, delete)
    return doc


def mutate_run_json(d: Path, data) -> None:
    info = json.loads((d / "run.json").read_text())
    info = mutated_json(info, sorted(set(RUN_FIELDS) | set(paths(info)), key=str), data)
    (d / "run.json").write_text(data.draw(st.just(dumps(info)) | LINE, label="run.json"))


def parsed(line: str) -> Any:
    """A line this test wrote, read back; a line it made unreadable on purpose is None."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def mutate_rows(d: Path, data) -> None:
    """One to three rows changed (a field, a nested field, the whole line), or a column: one field set to one value
    in every row, as a run would have written it (a JSONL's meta making every cell's depth "deep")."""
    lines = (d / "samples.jsonl").read_text().splitlines()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        row = parsed(lines[i])
        kind = data.draw(st.sampled_from(["field", "nested", "line", "column"]))
        if kind == "column":
            path = data.draw(st.sampled_from([(k,) for k in ROW_KEYS] + paths(row)))
            delete, value = data.draw(MUTATION)
            lines = [dumps(put(parsed(x), path, value, delete)) if isinstance(parsed(x), dict) else x for x in lines]
        elif kind == "line":
            lines[i] = data.draw(LINE)
        else:
            fields = paths(row) if kind == "nested" and paths(row) else [(k,) for k in ROW_KEYS]
            lines[i] = dumps(mutated_json(row, fields, data))
    (d / "samples.jsonl").write_text("\n".join(lines) + "\n")


def mutate_looks(d: Path, data) -> None:
    last = json.loads((d / "looks.jsonl").read_text().splitlines()[-1])
    record = mutated_json(copy.deepcopy(last), sorted(set(LOOK_FIELDS) | set(paths(last)), key=str), data)
    with (d / "looks.jsonl").open("a") as f:
        f.write(data.draw(st.just(dumps(record)) | LINE, label="looks.jsonl line") + "\n")


def mutate_verdict(d: Path, data) -> None:
    doc = json.loads((d / "verdict.json").read_text())
    doc = mutated_json(doc, paths(doc, depth=4), data)
    (d / "verdict.json").write_text(data.draw(st.just(dumps(doc)) | LINE, label="verdict.json"))


MUTATE = {"run.json": mutate_run_json, "samples.jsonl": mutate_rows, "looks.jsonl": mutate_looks,
          "verdict.json": mutate_verdict}  # fmt: skip


# --- the gate on records --------------------------------------------------------------------------------------------


@FUZZ
@given(file=st.sampled_from(["run.json", "samples.jsonl", "looks.jsonl"]), data=st.data())
def test_the_gate_judges_or_refuses_records_of_any_value(seed, file, data):
    with copy_of(seed) as d:
        MUTATE[file](d, data)
        event(f"{file}: gate exit {judged(d, '--gate', str(gate_file(d.parent, PASSING)))}")


def test_two_runs_each_mutated_are_judged_or_refused(seed, tmp_path):
    """The gate merges several folders (sample identities, labels, experiments): each of a few fixed mutations of
    run.json in one of two copies is judged or refused, never a crash."""
    cases = [{"data": {"files": {"x": 1, "y": "abc"}}}, {"model": {"name": ["a"]}}, {"config": {"seed": [1]}},
             {"config": {"task": {"name": {"a": 1}}}}, {"run_id": 10**400}, {"versions": {"torch": None}}]  # fmt: skip
    for i, change in enumerate(cases):
        a = Path(shutil.copytree(seed, tmp_path / f"{i}" / "a"))
        b = Path(shutil.copytree(seed, tmp_path / f"{i}" / "b"))
        info = json.loads((b / "run.json").read_text())
        for key, value in change.items():
            info[key] = {**info[key], **value} if isinstance(value, dict) and isinstance(info.get(key), dict) else value
        (b / "run.json").write_text(dumps(info))
        code, err = quiet(gate_main, [str(a), str(b), "--gate", str(gate_file(tmp_path / f"{i}", PASSING))])
        assert code in (0, 1, 2) and "Traceback" not in err, (change, err[-3000:])


# --- gate files ----------------------------------------------------------------------------------------------------

GATE_VALUE = VALUES | st.floats(0, 1) | st.integers(-3, 200) | st.sampled_from([1e-300, 1 - 1e-16, 10**9, 1e6])


def gate_values(data) -> Any:
    values: Any = dict(PASSING)
    for _ in range(data.draw(st.integers(1, 4))):
        key = data.draw(st.sampled_from(THRESHOLD_KEYS) | st.text(max_size=6) | st.integers())
        delete, value = data.draw(st.tuples(st.booleans(), GATE_VALUE))
        values = put(values, tuple(key.split(".")) if isinstance(key, str) else (key,), value, delete)
    return data.draw(st.just(values) | VALUES, label="gate file")


@FUZZ
@given(data=st.data())
def test_gate_files_of_any_value_are_judged_or_refused(seed, data):
    values = gate_values(data)
    with copy_of(seed) as d:
        try:
            path = gate_file(d.parent, values)
        except (yaml.YAMLError, UnicodeEncodeError):  # a value YAML cannot write (a lone surrogate): not a file
            return
        event(f"gate exit {judged(d, '--gate', str(path))}")


# --plan sizes a run by exact enumeration (seconds a gate; a confidence of 0.999999 or max_mean_kl 1e300 take minutes,
# left out): a few examples, at the ends of every range
EXTREME = st.fixed_dictionaries(
    {"max_drop": st.sampled_from([1e-300, 1e-17, 0.5, 1 - 1e-16]), "confidence": st.sampled_from([0.5 + 1e-16, 0.99]),
     "max_flip_rate": st.sampled_from([None, 0.0, 1e-300, 1.0]), "min_cell_accuracy": st.sampled_from([None, 0.0, 1.0]),
     "max_mean_kl": st.sampled_from([None, 0.0, 1e-300]), "min_samples": st.sampled_from([None, 1, 10**9])}
)  # fmt: skip


@settings(FUZZ, max_examples=4)
@given(values=EXTREME)
def test_plan_at_the_ends_of_every_range(tmp_path, values):
    code, err = quiet(gate_main, ["--plan", "--gate", str(gate_file(tmp_path, values))])
    assert code in (0, 2) and "Traceback" not in err, err[-3000:]


# --- the report: exit 0 or 2, and in a sweep never the gate's exit code replaced ---------------------------------


@settings(FUZZ, max_examples=max(1, EXAMPLES // 6))
@given(file=st.sampled_from(sorted(MUTATE)), data=st.data())
def test_the_report_draws_or_refuses_records_of_any_value(seed, file, data):
    with copy_of(seed) as d:
        MUTATE[file](d, data)
        event(f"{file}: report exit {reported(d)}")


@settings(FUZZ, max_examples=max(1, EXAMPLES // 16))
@given(file=st.sampled_from(["run.json", "samples.jsonl"]), data=st.data())
def test_a_sweep_exits_with_its_gates_code(seed, file, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sweep"
        job = Path(shutil.copytree(seed, root / "needle" / "tiny" / "job"))
        for name in ("verdict.json", "looks.jsonl", "report.md"):
            (job / name).unlink(missing_ok=True)
        MUTATE[file](job, data)
        cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(root)}},
                                "gate": OmegaConf.merge(compose_config("gate=default").gate, PASSING)})  # fmt: skip
        merged, err = quiet(lambda _: sweep.merge(cfg), None)
        assert merged in (0, 1, 2) and "Traceback" not in err, err[-3000:]
        assert judged(root, "--gate", str(gate_file(Path(tmp), PASSING))) == merged  # the same rows, the same verdict


# --- the planner ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_config():
    return plan_compose(["model=tiny-random"])


PLAN_VALUE = VALUES | st.integers(-(10**30), 10**30) | st.floats(-1e30, 1e30) | st.sampled_from(
    ["bfloat16", "float16", "float32", "fp8", "int4", "pcie5", "nvlink-c2c", 1e6, 10**8, 1e-300])  # fmt: skip


@settings(FUZZ, max_examples=max(1, EXAMPLES // 4))
@given(data=st.data())
def test_planner_values_of_any_value_plan_or_are_refused(plan_config, data):
    cfg = copy.deepcopy(plan_config)
    with tempfile.TemporaryDirectory() as tmp:
        plan = OmegaConf.to_container(cfg.plan)
        for _ in range(data.draw(st.integers(1, 3))):
            plan[data.draw(st.sampled_from(PLAN_KEYS))] = data.draw(PLAN_VALUE)
        if plan.get("out") is None or isinstance(plan.get("out"), str):  # written under this test's folder
            plan["out"] = str(Path(tmp) / "plan")
        try:
            cfg.plan = OmegaConf.create(plan)
        except Exception:  # noqa: BLE001 - a value OmegaConf cannot hold never reaches the planner
            return
        code, err = quiet(lambda _: guarded(lambda: plan_from(cfg)), None)
        assert code in (0, 2) and "Traceback" not in err, err[-3000:]
        event(f"planner exit {code}")
