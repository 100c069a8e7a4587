"""The gate judges runs as they are and believes no score it can derive: every case starts from real run folders of
the tiny random model and is changed the way a hostile user (or a killed run) would change it. Each was a PASS, a
verdict that ignored the change, or a traceback before; each is now refused (CANNOT JUDGE, exit 2, naming the file,
line and field), or judged with a line that says what the verdict stands on. The untouched folders still PASS and
FAIL (the controls).

The task: a JSONL file whose reference answer for each context is the full cache's own answer there (taken from a
first run), scored by containment. The baseline scores 1 on every sample; a lossless variant (none@1.0) answers the
same and scores 1; a lossy one (snapkv@0.1) changes most answers and loses them.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from evalkit.cli.gate import main
from evalkit.errors import ConfigError
from evalkit.records import read_rows
from tests.conftest import compose_config, run_cli

N = 24  # contexts, one question each
# Loose enough that 24 lossless samples PASS at the first look: 0 lost of 24 bounds the drop by 1 - 0.05**(1/24) =
# 0.117 < 0.3; a variant that loses most answers is shown above 0.3 (a FAIL).
LOOSE = "max_drop: 0.3\nmax_flip_rate: 0.3\nmin_cell_accuracy: null\nmax_mean_kl: null\n"
SAMPLES = "samples.jsonl"


def real_run(folder: Path, data: Path, *overrides: str) -> Path:
    """A run written by evalkit itself (evalkit.cli.job.run, in this process: the same code as the command line)."""
    from evalkit.cli.job import job_spec, run

    base = ["model=tiny-random", "task=jsonl", f"task.path={data}", "task.max_new_tokens=4"]
    run(*job_spec(compose_config(*base, *overrides), folder))
    return folder


def write_jsonl(path: Path, answers: dict[str, str]) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud"]
    with path.open("w") as f:
        for i in range(N):
            rng = random.Random(i)  # a context of its own for each question
            context = " ".join(rng.choice(words) for _ in range(60))
            row = {"id": f"q{i}", "context": context, "question": "Say something.", "meta": {"part": i % 3}}
            f.write(json.dumps({**row, "answers": [answers.get(f"q{i}", "x")]}) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("judged")
    first = real_run(root / "first", write_jsonl(root / "first.jsonl", {}), "variants=[none@1.0]")
    answers = {r["sample_id"]: r["prediction"] for r in read_rows(first / SAMPLES) if r["variant"] == "baseline"}
    assert all(a.strip() for a in answers.values()), answers  # every answer is a non-empty reference
    data = write_jsonl(root / "data.jsonl", answers)
    (root / "loose.yaml").write_text(LOOSE)
    (root / "partial.yaml").write_text(LOOSE + "allow_partial: true\n")
    return {
        "lossless": real_run(root / "lossless", data, "variants=[none@1.0]"),
        "lossy": real_run(root / "lossy", data, "variants=[snapkv@0.1]"),
        "data": data,
        "loose": root / "loose.yaml",
        "partial": root / "partial.yaml",
    }


def copy(runs: dict[str, Path], name: str, tmp_path: Path, as_name: str | None = None) -> Path:
    return Path(shutil.copytree(runs[name], tmp_path / (as_name or name)))


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / SAMPLES).read_text().splitlines()]


def write_rows(folder: Path, rows: list[dict]) -> None:
    (folder / SAMPLES).write_text("".join(json.dumps(r) + "\n" for r in rows))


def judge(capsys, runs, *folders: Path, gate: str = "loose") -> tuple[int, str, str]:
    code = main([*map(str, folders), "--gate", str(runs[gate])])
    out, err = capsys.readouterr()
    return code, out, err


def cannot_judge(capsys, runs, folder: Path, *messages: str) -> str:
    code, out, err = judge(capsys, runs, folder)
    assert code == 2, (out, err)
    assert "evalkit gate: CANNOT JUDGE" in out and "Traceback" not in out + err, (out, err)
    assert len(err.strip().splitlines()) == 1 and "cannot judge" in err, err
    for m in messages:
        assert m in out, out
    return out


# --- the controls ------------------------------------------------------------------------------------------------


def test_the_lossless_run_passes_and_the_lossy_one_fails(runs, capsys, tmp_path):
    code, out, _ = judge(capsys, runs, copy(runs, "lossless", tmp_path))
    assert code == 0 and "evalkit gate: PASS" in out, out
    code, out, _ = judge(capsys, runs, copy(runs, "lossy", tmp_path))
    assert code == 1 and "evalkit gate: FAIL" in out, out
    lossy = rows_of(runs["lossy"])
    assert all(r["scorer"] == {"name": "contains_all", "subtask": "", "extra": {}} for r in lossy)
    assert sum(r["flip"] == "lost" for r in lossy) > 0.3 * N  # the FAIL is the lost answers'


# --- scores re-derived from predictions ----------------------------------------------------------------------------


def _lost(rows: list[dict]) -> int:
    return next(i for i, r in enumerate(rows) if r["flip"] == "lost")


def scored_1(runs, tmp_path) -> tuple[Path, int]:
    """A copy of the lossy run with every lost row given score 1 and no flip (the rows agree with each other and
    with their baselines; each prediction still scores 0), and the line of the first."""
    d = copy(runs, "lossy", tmp_path)
    rows = rows_of(d)
    line = _lost(rows) + 1
    for r in rows:
        if r["flip"] == "lost":
            r["score"], r["flip"] = 1.0, None
    write_rows(d, rows)
    return d, line


def test_a_score_set_to_1_beside_a_wrong_prediction_is_refused(runs, capsys, tmp_path):
    """Every lost row of the lossy run given score 1 and no flip: the gate believed them (a PASS at 0 lost)."""
    d, line = scored_1(runs, tmp_path)
    cannot_judge(capsys, runs, d, f"{d / SAMPLES}:{line}: score=1.0 but its prediction", "scores 0 (contains_all)")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("prediction"), "has prediction=None, not a string"),
        (lambda r: r.update(prediction=None), "has prediction=None, not a string"),
        (lambda r: r.update(prediction=7301239), "has prediction=7301239, not a string"),
        (lambda r: r.pop("scorer"), "has scorer=None: the gate scores every prediction again"),
        (lambda r: r.update(scorer={"name": "contains_any"}), "has scorer 'contains_any' but its run's task is"),
        (lambda r: r.update(answers=[r["prediction"]]), "but the baseline row's answers (line"),
    ],
    ids=["prediction-deleted", "prediction-null", "prediction-number", "scorer-deleted", "scorer-other", "answers"],
)
def test_a_score_whose_prediction_cannot_be_scored_again_is_refused(runs, capsys, tmp_path, change, message):
    """Every lost row set to score 1 and no flip (believed, a PASS), with what re-scoring needs removed or changed."""
    d = copy(runs, "lossy", tmp_path)
    rows = rows_of(d)
    i = _lost(rows)
    for r in rows:
        if r["flip"] == "lost":
            r["score"], r["flip"] = 1.0, None
            change(r)
    write_rows(d, rows)
    cannot_judge(capsys, runs, d, f"{d / SAMPLES}:{i + 1}: ", message)


# --- fields the gate judges, deleted -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("context_id", "has no context_id"),
        ("tokens_held_per_layer", "has no tokens_held_per_layer"),
        ("kv_bytes_deployed", "has no kv_bytes_deployed"),
    ],
)
def test_a_deleted_field_the_gate_judges_is_refused_not_a_check_dropped(runs, capsys, tmp_path, field, message):
    """Before: a row without its context was its own context; without its tokens the bytes were not checked
    against them (fake byte counts PASSed); without deployed bytes the measured ones were used unchecked."""
    d = copy(runs, "lossless", tmp_path)
    rows = rows_of(d)
    for r in rows:
        r.pop(field)
    write_rows(d, rows)
    cannot_judge(capsys, runs, d, f"{d / SAMPLES}:1: {message}")


def test_fake_bytes_with_the_token_fields_removed_are_refused(runs, capsys, tmp_path):
    """No compression (none@1.0) claiming a quarter of the bytes, with the tokens that would contradict it gone."""
    d = copy(runs, "lossless", tmp_path)
    rows = rows_of(d)
    for r in rows:
        if r["variant"] != "baseline":
            r["kv_bytes"] //= 4
            r["kv_bytes_deployed"] //= 4
            r["policy"] = {**r["policy"], "budget": 0.25}
        for key in ("tokens_held_per_layer", "tokens_allowed_per_layer"):
            r.pop(key)
    write_rows(d, rows)
    cannot_judge(capsys, runs, d, "has no tokens_held_per_layer, tokens_allowed_per_layer")


# --- row fields of the wrong kind: one line, exit 2 ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("variant", 5, "has variant=5, not a variant's name"),
        ("policy", "h2o", "has policy='h2o', not an object"),
        ("prefill", "x", "has prefill='x', not an object or null"),
        ("context_tokens", "x", "has context_tokens='x', not a whole number of tokens > 0"),
        ("prefill_bound_tokens", 64, "has prefill_bound_tokens=64 but no prefill_peak_tokens"),
        ("evidence_retained_per_layer", [None], "has evidence_retained_per_layer=[None], not a list of shares"),
    ],
)
def test_a_row_field_of_the_wrong_kind_is_one_line_exit_2(runs, capsys, tmp_path, field, value, message):
    """Before: each was a traceback (exit 3): an int label split as a string, a string's .get, a string divided."""
    d = copy(runs, "lossless", tmp_path)
    rows = rows_of(d)
    rows[1][field] = value  # line 2: a none@1.0 row
    if field == "prefill_bound_tokens":
        rows[1].pop("prefill_peak_tokens")
    write_rows(d, rows)
    cannot_judge(capsys, runs, d, f"{d / SAMPLES}:2:", message)


# --- runs as they are ------------------------------------------------------------------------------------------------


def test_an_unfinished_run_never_passes_unless_allowed(runs, capsys, tmp_path):
    """A killed run: the rows of the last third of the samples (part 2's contexts among them) never written. Before:
    PASS with no word that the run had stopped."""
    d = copy(runs, "lossless", tmp_path)
    rows = rows_of(d)
    write_rows(d, rows[: 2 * (2 * N // 3)])  # two rows a sample: the first 16 samples
    code, out, _ = judge(capsys, runs, d)
    assert code == 2 and "evalkit gate: INCONCLUSIVE" in out, out
    assert f"the run is unfinished: 16 of the {N} samples it drew have rows (8 missing" in out
    verdict = json.loads((d / "verdict.json").read_text())
    assert verdict["verdict"] == "INCONCLUSIVE" and verdict["unfinished"]
    fresh = copy(runs, "lossless", tmp_path, "fresh")  # the same rows judged first at these thresholds
    write_rows(fresh, rows[: 2 * (2 * N // 3)])
    code, out, _ = judge(capsys, runs, fresh, gate="partial")
    assert code == 0 and "evalkit gate: PASS" in out and "note: " in out and "the run is unfinished" in out, out


def _disagree(folder: Path) -> None:
    """The same experiment run again, answering one sample otherwise: its baseline says something else there (and
    scores 0 for it), consistently in both of the sample's rows."""
    rows = rows_of(folder)
    for r in rows:
        if r["sample_id"] == "q3":
            if r["variant"] == "baseline":
                r["prediction"], r["score"] = "-", 0.0
            r["baseline_score"] = 0.0
            r["flip"] = None if r["score"] == 0.0 else "gained"
    write_rows(folder, rows)


def test_two_folders_of_one_experiment_that_disagree_are_refused_naming_both(runs, capsys, tmp_path):
    """Before: one folder's rows of the sample were dropped, which one depending on the folder names."""
    a, b = copy(runs, "lossless", tmp_path, "a"), copy(runs, "lossless", tmp_path, "b")
    _disagree(b)
    code, out, err = judge(capsys, runs, a, b)
    assert code == 2 and "CANNOT JUDGE" in out, out
    assert f"{a.resolve()} and {b.resolve()} are the same experiment" in out and "sample 'q3'" in out, out
    # the control: each folder alone is judged, and two identical copies are one measurement
    assert judge(capsys, runs, b)[0] == 0
    assert judge(capsys, runs, a, copy(runs, "lossless", tmp_path, "c"))[0] == 0


def test_one_server_for_two_variants_is_refused(runs, capsys, tmp_path):
    """backend=openai with the baseline's server named again as the variant's: KL 0 and agreement 1 whatever the
    declared dtype. Refused before a request is sent, and in a run.json that says so."""
    url = "http://127.0.0.1:9/v1"
    result = run_cli(
        "model=tiny-random", "backend=openai", f"task.path={runs['data']}", "task=jsonl",
        f"backend.endpoints={{baseline:'{url}',q4_0:'{url}/'}}", f"hydra.run.dir={tmp_path / 'served'}",
    )  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "endpoints 'baseline' and 'q4_0' are the same server" in lines[0]
    d = copy(runs, "lossless", tmp_path)
    info = json.loads((d / "run.json").read_text())
    info["engine"] = {"endpoints": {"baseline": url, "none@1.0": url}}
    (d / "run.json").write_text(json.dumps(info))
    cannot_judge(capsys, runs, d, "endpoints 'baseline' and 'none@1.0' are the same server")


@pytest.mark.parametrize("flag", ["external", "teacher_forced"])
def test_a_flag_in_run_json_does_not_turn_the_rescoring_off(runs, capsys, tmp_path, flag):
    """Before: `"external": true` (or `"teacher_forced": true`) in run.json's config.task told the gate that lm-eval
    (or the logits) had scored the rows: no prediction was scored again and no unfinished run was found, so lost rows
    given score 1 PASSed. What scored a run is its task's class (`_target_`), never a flag in the file."""
    d, line = scored_1(runs, tmp_path)
    info = json.loads((d / "run.json").read_text())
    info["config"]["task"][flag] = True
    (d / "run.json").write_text(json.dumps(info))
    cannot_judge(capsys, runs, d, f"{d / SAMPLES}:{line}: score=1.0 but its prediction")


def test_the_same_dataset_under_another_seed_is_the_same_samples(runs, capsys, tmp_path):
    """A JSONL dataset that no seed changes, run again with seed=1: the same 24 samples (their content digests in
    run.json), merged once, not 48 (before: every question counted twice, each run's folder a sample identity of its
    own). Control: the first run's data, whose answers differ, are other samples under the same ids: 48."""
    again = real_run(tmp_path / "seed1", runs["data"], "variants=[none@1.0]", "seed=1")
    a = copy(runs, "lossless", tmp_path, "a")
    code, _, _ = judge(capsys, runs, a, again)
    assert code == 0 and json.loads((a / "verdict.json").read_text())["variants"]["none@1.0"]["n"] == N
    first = Path(shutil.copytree(runs["data"].parent / "first", tmp_path / "first"))
    b = copy(runs, "lossless", tmp_path, "b")
    judge(capsys, runs, b, first)
    assert json.loads((b / "verdict.json").read_text())["variants"]["none@1.0"]["n"] == 2 * N


def test_rows_of_evalkits_own_engine_under_another_backend_are_refused(runs, capsys, tmp_path):
    """Rows written by evalkit's engine (engine_version transformers ...) in a run.json that says llama.cpp ran them:
    before, the fields only evalkit's engine must carry (tokens held, deployed bytes) were not asked for."""
    d = copy(runs, "lossless", tmp_path)
    rows = rows_of(d)
    for r in rows:
        r["backend"] = "llamacpp"
    write_rows(d, rows)
    info = json.loads((d / "run.json").read_text())
    info["config"]["backend"] = {"name": "llamacpp"}
    (d / "run.json").write_text(json.dumps(info))
    cannot_judge(capsys, runs, d, f"{d / SAMPLES}:1: has engine_version='transformers", "backend 'llamacpp'")


def test_declared_bytes_are_labelled_and_a_pass_on_them_says_so_first(runs, capsys, tmp_path):
    """Rows as backend=openai writes them (bytes declared from a dtype, the backend named in rows and run.json).
    Before: PASS with nothing in verdict.json, report.md or the console saying the bytes were never observed."""
    d = copy(runs, "lossless", tmp_path)
    rows = rows_of(d)
    for r in rows:
        r["backend"] = "openai"
        r["engine_version"] = "0.11.0"  # what the server's GET /version answers
        r["kv_bytes_source"] = "declared: bfloat16, 2 bytes per value (evalkit.plan)"
    write_rows(d, rows)
    info = json.loads((d / "run.json").read_text())
    info["config"]["backend"] = {"name": "openai"}
    (d / "run.json").write_text(json.dumps(info))
    code, out, _ = judge(capsys, runs, d)
    assert code == 0, out
    assert out.strip().splitlines()[0].startswith("evalkit gate: PASS on declared KV bytes (none@1.0"), out
    verdict = json.loads((d / "verdict.json").read_text())
    assert verdict["declared_bytes"] == ["none@1.0"] and verdict["variants"]["none@1.0"]["kv_ratio_basis"] == "declared"
    assert (d / "report.md").read_text().startswith("# evalkit gate: PASS on declared KV bytes")


# --- resume re-derives what it carries ----------------------------------------------------------------------------


def _variant_scored_0(rows: list[dict], **fields) -> None:
    """Line 2 (sample q0's none@1.0 row) given score 0, a lost flip that agrees with it, and `fields`."""
    rows[1].update(score=0.0, flip="lost", **fields)


@pytest.mark.parametrize(
    ("change", "line", "message"),
    [
        (lambda rows: rows[0].pop("score"), 1, "has no score"),
        (lambda rows: _variant_scored_0(rows, prediction=None), 2, "prediction=None, not the text its score was"),
        (lambda rows: (_variant_scored_0(rows), rows[1].pop("prediction")), 2, "prediction=None, not the text"),
        (lambda rows: _variant_scored_0(rows, prediction=11), 2, "prediction=11, not the text"),
        (lambda rows: [r.pop("context_id") for r in rows[:2]], 1, "context_id=None, but the sample's prompt"),
    ],
    ids=["baseline-without-score", "prediction-null", "prediction-deleted", "prediction-number", "context-deleted"],
)
def test_resume_refuses_a_row_it_cannot_derive_again(runs, tmp_path, change, line, message):
    """Before: a baseline row without its score was a KeyError (exit 3); an edited score beside a prediction that is
    null, deleted or a number, and a context_id deleted from a sample's rows, were carried into the extended run."""
    d = copy(runs, "lossless", tmp_path)
    rows = rows_of(d)
    change(rows)
    write_rows(d, rows)
    with pytest.raises(ConfigError, match="resume=true, but a row already written") as err:
        real_run(d, runs["data"], "variants=[none@1.0]", "resume=true")
    assert f"{d / SAMPLES}:{line}: " in str(err.value) and message in str(err.value), str(err.value)
