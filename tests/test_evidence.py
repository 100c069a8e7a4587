"""The gate judges evidence, not files: every case below starts from real run folders (tiny-random, teacher-forced
fidelity: the baseline scores 1 on every sample by construction, a lossless variant 1, a lossy one less), and
breaks them the way a hostile user would. Each was a PASS (exit 0) or a crash (exit 3) before; each is now CANNOT
JUDGE (exit 2) naming the file, line and field, while the untouched folders still PASS and FAIL (the controls).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from evalkit.cli.gate import main
from evalkit.records import read_rows
from tests.conftest import compose_config

FIDELITY = ["model=tiny-random", "task=fidelity", "task.context_lengths=[128]", "task.continuation_tokens=8"]
# samples of the lossless run: 0 lost and KL 0. Its mean KL, each row capped at 3 nats, is shown below 0.1 nats from
# 112 samples: the bet's four fractions gain (0.1 / 3) / (1 - 0.1 / 3) x 1, 0.8, 0.6, 0.4 a sample, and their mean
# wealth first reaches 1 / 0.05 = 20 at 112 (by hand, as tests/test_gate_statistics.py's mixture_wealth); the share
# of rows above that cap is shown below max_kl_tail_share (0.01) from 378 (tests/test_gate_statistics.py, by hand)
N_PASS = 380
N = 24  # samples of the lossy runs


def real_run(folder: Path, *overrides: str) -> Path:
    """A run written by evalkit itself (evalkit.cli.job.run, in this process: the same code as the command line)."""
    from evalkit.cli.job import job_spec, run

    run(*job_spec(compose_config(*FIDELITY, *overrides), folder))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "lossless": real_run(root / "lossless", f"task.samples_per_cell={N_PASS}", "variants=[none@1.0]"),
        "seed0": real_run(root / "seed0", f"task.samples_per_cell={N}", "variants=[streaming_llm@0.25]"),
        "seed7": real_run(root / "seed7", f"task.samples_per_cell={N}", "variants=[streaming_llm@0.25]", "seed=7"),
    }


def copy(runs: dict[str, Path], name: str, tmp_path: Path) -> Path:
    """A copy of the shared run `name` in tmp_path, for a test to edit."""
    return Path(shutil.copytree(runs[name], tmp_path / name))


def edit_rows(folder: Path, change) -> None:
    """Rewrite samples.jsonl with change(row) applied to every row (it edits the row in place)."""
    rows = [dict(r) for r in read_rows(folder / "samples.jsonl")]  # as the file holds them, to edit
    for r in rows:
        change(r)
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def judge(capsys, *folders: Path, args=()) -> tuple[int, str, str]:
    code = main([*map(str, folders), *args])
    out, err = capsys.readouterr()
    return code, out, err


def cannot_judge(capsys, folder: Path, *messages: str) -> str:
    code, out, err = judge(capsys, folder)
    assert code == 2, (out, err)
    assert "evalkit gate: CANNOT JUDGE" in out and "Traceback" not in out + err, (out, err)
    assert len(err.strip().splitlines()) == 1 and "cannot judge" in err
    for m in messages:
        assert m in out, out
    return out


# --- the controls: real folders, untouched -----------------------------------------------------------------------


def test_the_lossless_run_passes_and_the_lossy_one_fails(runs, capsys, tmp_path):
    code, out, _ = judge(capsys, copy(runs, "lossless", tmp_path))
    assert code == 0 and "evalkit gate: PASS" in out
    code, out, _ = judge(capsys, copy(runs, "seed0", tmp_path))
    assert code == 1 and "evalkit gate: FAIL" in out


def test_every_row_names_its_context_and_what_its_budget_allowed(runs):
    rows = [dict(r) for r in read_rows(runs["seed0"] / "samples.jsonl")]  # as the file holds them, to edit
    by_sample = {}
    for r in rows:
        by_sample.setdefault(r["sample_id"], set()).add(r["context_id"])
    # one prefill per sample here: the baseline and the variant rows of a sample name the same context, 16 hex digits
    assert all(len(ids) == 1 and len(next(iter(ids))) == 16 for ids in by_sample.values())
    assert len({next(iter(ids)) for ids in by_sample.values()}) == N  # different texts, different contexts
    policy = next(r for r in rows if r["variant"] == "streaming_llm@0.25")
    n = policy["context_tokens"]
    # streaming_llm@0.25: ceil(0.25 n) tokens per head, at least its 4 sinks + 1; the tiny model has 3 layers
    assert policy["tokens_allowed_per_layer"] == [max(math.ceil(0.25 * n), 5)] * 3
    assert policy["tokens_held_per_layer"] == policy["tokens_allowed_per_layer"]


# --- 1. one sample identity across folders ------------------------------------------------------------------------


def test_folders_whose_sample_ids_collide_are_kept_apart_whatever_their_order(runs, capsys, tmp_path):
    """seed=0 and seed=7 both number their samples L128-0 .. L128-23: other texts, the same ids. Merged by id, the
    second folder's rows were dropped (n=24, not 48) and the verdict depended on the order of the folders."""
    a, b = copy(runs, "seed0", tmp_path), copy(runs, "seed7", tmp_path)
    judge(capsys, a, b, args=("--out", str(tmp_path / "ab")))
    judge(capsys, b, a, args=("--out", str(tmp_path / "ba")))
    ab = json.loads((tmp_path / "ab" / "verdict.json").read_text())
    ba = json.loads((tmp_path / "ba" / "verdict.json").read_text())
    assert ab["variants"]["streaming_llm@0.25"]["n"] == 2 * N
    assert ab["variants"]["baseline"]["n"] == 2 * N
    for doc in (ab, ba):
        doc.pop("runs")
        doc["look"].pop("at")  # when it was judged; the second judgement of the same rows is the same look
    assert ab == ba


def test_the_same_run_twice_is_one_measurement(runs, capsys, tmp_path):
    """A sweep's jobs repeat the baseline: the same samples (same identity) with the same answers count once."""
    a = copy(runs, "seed0", tmp_path)
    b = Path(shutil.copytree(a, tmp_path / "again"))
    code, _, _ = judge(capsys, a, b, args=("--out", str(tmp_path / "out")))
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert code == 1 and verdict["variants"]["streaming_llm@0.25"]["n"] == N


# --- 2. the baseline's score comes from the baseline row -------------------------------------------------------


def test_a_variant_row_claiming_a_low_baseline_score_is_refused(runs, capsys, tmp_path):
    """The variant rows say score 0 and baseline_score 0 (no flip) beside baseline rows that score 1: believed, the
    drop was 0 and the gate said PASS while verdict.json showed baseline 1.0 and variant 0.0."""
    d = copy(runs, "lossless", tmp_path)

    def zero(r):
        if r["variant"] != "baseline":
            r["score"] = r["baseline_score"] = r["top1_agreement"] = 0.0

    edit_rows(d, zero)
    cannot_judge(capsys, d, f"{d / 'samples.jsonl'}:2: baseline_score=0.0 but the baseline row's score (line 1) is 1.0")


def test_a_flip_that_the_scores_do_not_make_is_refused(runs, capsys, tmp_path):
    d = copy(runs, "seed0", tmp_path)
    rows = [dict(r) for r in read_rows(d / "samples.jsonl")]  # as the file holds them, to edit
    line = next(i for i, r in enumerate(rows, 1) if r["variant"] != "baseline" and r["score"] < 1)
    rows[line - 1]["flip"] = "gained"
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cannot_judge(capsys, d, f"{d / 'samples.jsonl'}:{line}: flip='gained', but score")


# --- 3. bytes, scores and run metadata ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kv_bytes", -5, "has kv_bytes=-5, not a finite number of bytes >= 0"),
        ("kv_bytes_baseline", 0, "has kv_bytes_baseline=0: the full cache holds some bytes"),
        ("score", math.nan, "has score=nan, outside the scorers' range [0, 1]"),
        ("score", math.inf, "has score=inf, outside the scorers' range [0, 1]"),
        ("score", 1.5, "has score=1.5, outside the scorers' range [0, 1]"),
        ("kv_bytes_deployed", 1, "kv_bytes_deployed=1 but its"),
        # before: the budget and bytes checks skipped a string (a PASS at a quarter of the bytes claimed)
        ("tokens_held_per_layer", "n/a", "has tokens_held_per_layer='n/a', not a list of token counts >= 0"),
        ("prefill_peak_kv_bytes", "x", "has prefill_peak_kv_bytes='x', not a finite number of bytes"),  # exit 3
        ("cell", {"context_length": 128, "depth": [1]}, "a cell's values are single numbers or strings"),  # exit 3
        ("sample_id", "s\ud800", "holds an escape that is no Unicode character (a lone surrogate"),  # exit 3
    ],
    ids=[
        "negative-bytes",
        "zero-baseline-bytes",
        "nan-score",
        "inf-score",
        "score-over-1",
        "bytes-not-held",
        "tokens-held-not-a-list",
        "prefill-peak-not-bytes",
        "cell-value-a-list",
        "lone-surrogate",
    ],
)
def test_impossible_numbers_are_refused(runs, capsys, tmp_path, field, value, message):
    """Before: kv_bytes=-5 PASSed at ratio -0.00004; zero baseline bytes was a ZeroDivisionError (exit 3); NaN or
    inf scores ended in exit 3 (quantiles out of range); deployed bytes were believed whatever the tokens held."""
    d = copy(runs, "lossless", tmp_path)
    rows = [dict(r) for r in read_rows(d / "samples.jsonl")]  # as the file holds them, to edit
    rows[1][field] = value  # line 2: the first none@1.0 row
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cannot_judge(capsys, d, f"{d / 'samples.jsonl'}:2:", message)


def test_tokens_held_beyond_what_the_budget_allowed_are_refused(runs, capsys, tmp_path):
    d = copy(runs, "seed0", tmp_path)

    def more(r):
        if r["variant"] != "baseline":
            r["tokens_held_per_layer"] = [r["context_tokens"]] * 3

    edit_rows(d, more)
    cannot_judge(capsys, d, "tokens_held_per_layer sums to", "over the")


@pytest.mark.parametrize(
    ("change", "missing"),
    [
        (lambda info: {}, "config, model.fingerprint, versions.torch"),
        (lambda info: {**info, "model": {"name": "tiny-random"}}, "model.fingerprint"),
        (lambda info: {k: v for k, v in info.items() if k != "versions"}, "versions.torch"),
        (lambda info: {k: v for k, v in info.items() if k != "config"}, "config"),
    ],
    ids=["empty", "no-fingerprint", "no-versions", "no-config"],
)
def test_a_run_json_without_config_fingerprint_or_versions_is_refused(runs, capsys, tmp_path, change, missing):
    """Before: run.json reduced to {} or stripped of the fingerprint and versions PASSed without a word."""
    d = copy(runs, "lossless", tmp_path)
    info = json.loads((d / "run.json").read_text())
    (d / "run.json").write_text(json.dumps(change(info)))
    cannot_judge(capsys, d, f"{d / 'run.json'}: lacks {missing}")


# --- 4. thresholds typed and ranged --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("min_compression: 2.0\n", "gate.min_compression=2.0: give a number in (0, 1]"),
        ("min_compression: .nan\n", "gate.min_compression=nan: give a number in (0, 1]"),
        ("max_drop: null\nmax_flip_rate: null\nmin_cell_accuracy: null\n", "max_drop and max_flip_rate are both null"),
        ("- 0.05\n- 0.1\n", "is a list, not a mapping of thresholds"),
        ("confidence: 1\n", "gate.confidence=1: give a number in (0.5, 1)"),
        ("max_flip_rate: -0.1\n", "gate.max_flip_rate=-0.1: give a number in [0, 1]"),
        ("min_samples: 2.5\n", "gate.min_samples=2.5: give a whole number in [1, 1e+09]"),
        ("max_drop: ${nope}\n", "max_drop cannot be resolved (Interpolation key 'nope' not found); give max_drop a"),
    ],
    ids=[
        "compression-over-1",
        "compression-nan",
        "no-accuracy-check",
        "a-list",
        "confidence-1",
        "rate",
        "samples",
        "interpolation",
    ],
)
def test_bad_thresholds_are_one_line_exit_2(runs, capsys, tmp_path, yaml, message):
    """Before: min_compression 2.0 PASSed a variant at 1.000x; all accuracy checks null PASSed 0.00 against 1.00; a
    YAML list or a NaN was exit 3."""
    (tmp_path / "gate.yaml").write_text(yaml)
    code, out, err = judge(capsys, copy(runs, "seed0", tmp_path), args=("--gate", str(tmp_path / "gate.yaml")))
    assert code == 2 and out == "" and err.strip().splitlines() == [f"evalkit: error: {err.strip()[16:]}"]
    assert message in err, err


# --- an edited row is not carried into an extended run ------------------------------------------------------------


def test_an_edited_score_stops_the_run_that_would_extend_it(runs, tmp_path):
    """resume=true with more samples kept the rows already written as they were: an edited score was carried into
    the extended run silently. The score is re-derived from the prediction (here, a teacher-forced task: from the
    rows' own cross-checks; see test_resume for a generated one)."""
    from evalkit.errors import ConfigError

    d = copy(runs, "seed0", tmp_path)
    rows = [dict(r) for r in read_rows(d / "samples.jsonl")]  # as the file holds them, to edit
    rows[3]["baseline_score"] = 0.5  # line 4, a variant row
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"{d / 'samples.jsonl'}:4: baseline_score=0.5 but the baseline row"):
        real_run(d, f"task.samples_per_cell={N + 2}", "variants=[streaming_llm@0.25]", "resume=true")


# --- a field the gate judges, missing from one row ----------------------------------------------------------------


@pytest.mark.parametrize("deleted", [True, False], ids=["deleted", "null"])
def test_one_row_without_its_kl_is_refused_not_the_kl_check_dropped(runs, capsys, tmp_path, deleted):
    """The lossless run with its KL made to fail (every variant row's kl_mean at 5 nats, 50x max_mean_kl) and the
    first variant row's KL then removed: before, deleted, the KL check was dropped for the whole variant (the FAIL
    became a PASS); set to null, the summary's mean crashed (exit 3)."""
    d = copy(runs, "lossless", tmp_path)
    rows = [dict(r) for r in read_rows(d / "samples.jsonl")]  # as the file holds them, to edit
    for r in rows:
        if r["variant"] != "baseline":
            r["kl_mean"] = 5.0
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = judge(capsys, d)  # the control: every row with its KL, a FAIL on it
    assert code == 1 and "mean KL" in out, out
    rows[1].pop("kl_mean") if deleted else rows[1].update(kl_mean=None)  # line 2, the first none@1.0 row
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cannot_judge(capsys, d, f"{d / 'samples.jsonl'}:2: has no kl_mean, which the other rows of its variant")


def test_a_teacher_forced_score_that_is_not_its_agreement_is_refused(runs, capsys, tmp_path):
    """A fidelity row's score is its top-1 agreement with the baseline's logits: every lossy row raised to 1."""
    d = copy(runs, "seed0", tmp_path)
    rows = [dict(r) for r in read_rows(d / "samples.jsonl")]  # as the file holds them, to edit
    for r in rows:
        r["score"] = 1.0
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = next(i for i, r in enumerate(rows, 1) if r["top1_agreement"] < 1)
    cannot_judge(capsys, d, f"{d / 'samples.jsonl'}:{line}: score=1.0 but its top1_agreement is")
