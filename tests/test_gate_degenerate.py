"""The gate fails closed: records it cannot judge are exit code 2, CANNOT JUDGE, never a PASS and never a FAIL.

Every case starts from one healthy, hand-built run folder (which PASSes, exit 0: the positive control) and breaks it
in one way. The expected messages and counts are derived by hand from the folder built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from evalkit.cli import sweep
from evalkit.cli.gate import main
from evalkit.errors import ConfigError
from evalkit.gate import gating
from evalkit.records import cut_torn, read_rows
from evalkit.report import build as report_module
from evalkit.report.__main__ import main as report_main
from tests.conftest import as_written, compose_config, drew, run_cli

N = 24  # samples: enough for a FAIL or CANNOT JUDGE; a PASS needs 74 at the default margin (N_PASS)
N_PASS = 74
DEPTHS = [0.0, 0.5, 1.0]  # cell of sample i: depth DEPTHS[i % 3], so 8 samples a cell
RUN_ID = "run-a"
INFO = {
    "run_id": RUN_ID,
    "config": {"task": {"name": "needle"}, "seed": 0, "protocol": "query_agnostic"},
    "protocol": "query_agnostic",
    "versions": {"torch": "2.13.0", "transformers": "5.24.0", "evalkit": "0.1.0"},
    "model": {"name": "m", "fingerprint": "sha256:0", "weights_bytes": 1000},
}


def healthy(base=lambda i: 1.0, pol=lambda i: 1.0, ids=range(N), run_id=RUN_ID) -> list[dict]:
    """Two rows per sample, the baseline's then snapkv@0.25's, with the fields the gate reads, as a run writes them."""
    out = []
    for i in ids:
        b, p = base(i), pol(i)
        common = {
            "run_id": run_id,
            "sample_id": f"s{i}",
            "task": "needle",
            "protocol": "query_agnostic",
            "cell": {"context_length": 1024, "depth": DEPTHS[i % 3]},
            "baseline_score": b,
            "kv_bytes_baseline": 1000,
            "peak_kv_bytes": 1000,
            "prefill": {"mode": "oneshot"},
            "quant": None,
            "context_tokens": 100,
        }
        out.append({**common, "variant": "baseline", "policy": {"name": "baseline"}, "score": b, "kv_bytes": 1000})
        policy = {"name": "snapkv", "budget": 0.25, "window": 32}
        flip = None if p == b else ("lost" if p < b else "gained")
        out.append({**common, "variant": "snapkv@0.25", "policy": policy, "score": p, "kv_bytes": 250, "flip": flip})
    return as_written(out)


def lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def folder(tmp_path: Path, rows: list[dict] | None = None, text: str | None = None, info=INFO) -> Path:
    """A run folder: samples.jsonl (the rows, or `text` as is) and run.json (`info`; None: no run.json)."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "samples.jsonl").write_text(text if text is not None else lines(healthy() if rows is None else rows))
    if info is not None:
        written = rows if rows is not None else healthy() if text is None else _parsed(text)
        (d / "run.json").write_text(info if isinstance(info, str) else json.dumps(drew(info, written)))
    return d


def _parsed(text: str) -> list[dict]:
    """The rows of a samples.jsonl's text that are JSON objects (a corrupt line is the test's subject)."""
    out = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        out += [row] if isinstance(row, dict) else []
    return out


def gate(capsys, d: Path, *args: str) -> tuple[int, str, str]:
    code = main([str(d), *args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_cannot_judge(capsys, d: Path, *messages: str, args=()) -> dict:
    code, out, err = gate(capsys, d, *args)
    assert code == 2, (out, err)
    assert "evalkit gate: CANNOT JUDGE" in out and "PASS" not in out and "FAIL" not in out
    err_lines = err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("evalkit: error: the gate cannot judge these records: ")
    assert "Traceback" not in out + err
    for message in messages:
        assert message in out, out
    verdict = json.loads((d / "verdict.json").read_text())
    assert verdict["verdict"] == "CANNOT JUDGE"
    assert all(any(m in r for r in verdict["reasons"]) for m in messages), verdict["reasons"]
    assert (d / "report.md").read_text().startswith("# evalkit gate: CANNOT JUDGE")
    return verdict


def test_positive_control_a_healthy_run_passes(tmp_path, capsys):
    # 60 samples, baseline and policy both 1.0: no flips; the drop's 95% upper bound 1 - 0.05**(1/60) = 0.0487 is
    # below the 0.05 margin; every cell 1.0; KV 250/1000
    d = folder(tmp_path, healthy(ids=range(N_PASS)))
    code, out, err = gate(capsys, d)
    assert code == 0, (out, err)
    assert "evalkit gate: PASS" in out and err == ""
    verdict = json.loads((d / "verdict.json").read_text())
    assert verdict["verdict"] == "PASS" and verdict["reasons"] == [] and verdict["not_judged"] == []
    assert verdict["variants"]["snapkv@0.25"]["n"] == N_PASS and verdict["variants"]["snapkv@0.25"]["kv_ratio"] == 0.25


def test_positive_control_a_worse_policy_fails_with_1(tmp_path, capsys):
    # the policy loses every sample at depth 0.0 (8 of 24): 33% flipped, over 10%
    d = folder(tmp_path, healthy(pol=lambda i: 0.0 if i % 3 == 0 else 1.0))
    code, out, _ = gate(capsys, d)
    assert code == 1 and "evalkit gate: FAIL" in out and "8 of 24 samples flipped from right to wrong" in out


def test_rows_appended_to_their_own_file(tmp_path, capsys):
    # 48 rows written twice: 48 repeats, the first is line 49 (the first row of the copy) repeating line 1
    d = folder(tmp_path, text=lines(healthy()) * 2)
    assert_cannot_judge(
        capsys,
        d,
        f"{d / 'samples.jsonl'}: 48 rows repeat a (sample, variant) already recorded "
        "(first: sample 's0', variant 'baseline', lines 1 and 49)",
    )


def test_two_runs_in_one_file(tmp_path, capsys):
    # two jobs wrote the same folder: samples s0..s23 by run-a, s24..s47 by run-b (no repeated row)
    rows = healthy() + healthy(ids=range(N, 2 * N), run_id="run-b")
    d = folder(tmp_path, rows)
    assert_cannot_judge(capsys, d, "rows of 2 runs in one file (run ids run-a, run-b): several runs wrote the same")


def test_rows_of_another_run_than_their_run_json(tmp_path, capsys):
    d = folder(tmp_path, healthy(run_id="run-b"))
    assert_cannot_judge(capsys, d, "the rows were written by run run-b, but the run.json beside them is run run-a's")


def test_two_configurations_in_one_file(tmp_path, capsys):
    # snapkv@0.25 recorded with two observation windows (a run.json that names no run: the rows' run is not checked)
    rows = healthy()
    for r in rows[1:N:2]:  # the policy rows of samples s0..s11
        r["policy"] = {**r["policy"], "window": 8}
    d = folder(tmp_path, rows, info={"protocol": "query_agnostic"})
    assert_cannot_judge(capsys, d, "variants snapkv@0.25 recorded with different settings")


@pytest.mark.parametrize("n", [1, N])
def test_only_baseline_rows(tmp_path, capsys, n):
    rows = [r for r in healthy() if r["variant"] == "baseline"][:n]
    d = folder(tmp_path, rows)
    assert_cannot_judge(capsys, d, f"only baseline rows ({n} sample{'s' if n > 1 else ''}), no policy rows")


def test_no_baseline_rows(tmp_path, capsys):
    d = folder(tmp_path, [r for r in healthy() if r["variant"] != "baseline"])
    assert_cannot_judge(capsys, d, "no baseline rows")


def test_a_variant_not_run_on_the_baseline_samples(tmp_path, capsys):
    # the policy rows of s21, s22, s23 are gone (an unfinished run), and one policy row of a sample x1 was added
    rows = [r for r in healthy() if not (r["variant"] != "baseline" and r["sample_id"] in ("s21", "s22", "s23"))]
    rows.append({**rows[1], "sample_id": "x1"})
    d = folder(tmp_path, rows)
    assert_cannot_judge(
        capsys,
        d,
        "variant 'snapkv@0.25' lacks 3 of the baseline's 24 samples (s21, s22, s23) and has 1 sample the baseline "
        "lacks (x1)",
        "finish the run with resume=true",
    )


def test_a_baseline_that_cannot_do_the_task(tmp_path, capsys):
    # baseline and policy both 0: today's gate said PASS (no drop, no flip)
    d = folder(tmp_path, healthy(base=lambda i: 0.0, pol=lambda i: 0.0))
    verdict = assert_cannot_judge(
        capsys,
        d,
        "the full-cache baseline scores 0.00 on this task (gate.min_baseline_accuracy is 0.5): nothing can be learned "
        "about the policy; use a stronger model or an easier task",
    )
    assert verdict["variants"]["baseline"]["accuracy"] == 0.0  # the tables are still written
    # null switches the check off: then judged; nothing lost of 24 is not yet shown below the margin (74 needed), and
    # the next look is the anytime-valid test, which needs 74 (tests/test_stats.py, lossless_betting_count)
    off = tmp_path / "off.yaml"
    off.write_text("min_baseline_accuracy: null\n")
    code, out, _ = gate(capsys, d, "--gate", str(off))
    assert code == 2 and "evalkit gate: INCONCLUSIVE" in out and "add at least 50" in out


def test_cells_where_the_baseline_fails_are_named_not_judged(tmp_path, capsys):
    # the baseline fails at depth 0.5 (20 of 60 samples): 40/60 = 0.67 overall, above 0.5, so the run is judged; the
    # policy matches it everywhere, so it passes, and the depth 0.5 cell is named as not judged
    fails = lambda i: 0.0 if i % 3 == 1 else 1.0  # noqa: E731
    d = folder(tmp_path, healthy(base=fails, pol=fails, ids=range(N_PASS)))
    code, out, _ = gate(capsys, d)
    assert code == 0 and "evalkit gate: PASS" in out
    cell = "cell context_length=1024 depth=0.5: the baseline scores 0.00 there, below 0.5"
    assert f"not judged: {cell}" in out
    assert json.loads((d / "verdict.json").read_text())["not_judged"] == [cell]
    assert f"- not judged: {cell}" in (d / "report.md").read_text()


def test_teacher_forced_fidelity_rows_are_judged(tmp_path, capsys):
    # fidelity rows: the baseline scores 1.0 by construction (top-1 agreement with itself). Rows at KL 0.01, capped at
    # 3 nats, none above the cap: PASS from 378, where the share above the cap is shown below max_kl_tail_share
    # (tests/test_gate_statistics.py)
    rows = [
        {**r, "task": "fidelity", "kl_mean": 0.0 if r["variant"] == "baseline" else 0.01}
        for r in healthy(ids=range(378))
    ]
    code, out, _ = gate(capsys, folder(tmp_path, rows))
    assert code == 0 and "evalkit gate: PASS" in out


@pytest.mark.parametrize(
    ("info", "message"),
    [
        (None, "run.json: missing; the gate needs the run.json its run wrote"),
        ("", "run.json: empty"),
        ("{not json", "run.json: not valid JSON"),
        ("[1, 2]", "run.json: not a JSON object"),
    ],
    ids=["missing", "empty", "corrupt", "not-an-object"],
)
def test_a_run_json_that_cannot_be_used(tmp_path, capsys, info, message):
    d = folder(tmp_path, info=info)
    assert_cannot_judge(capsys, d, f"{d}/{message}")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model": "tiny"}, "lacks model.fingerprint"),  # the first of its problems
        ({"model": {**INFO["model"], "weights_bytes": "big"}}, "model.weights_bytes is 'big', not bytes"),
        ({"config": {**INFO["config"], "task": ["needle"]}}, "config.task is ['needle'], not an object"),
        ({"data": {"files": ["a.jsonl"]}}, "data.files is ['a.jsonl'], not an object, a digest per input file"),
        ({"engine": {"endpoints": ["http://a", "http://a"]}}, "engine.endpoints is ['http://a', 'http://a'], not an"),
    ],
    ids=["model-a-string", "weights-a-string", "task-a-list", "files-a-list", "endpoints-a-list"],
)
def test_a_run_json_field_of_the_wrong_kind_is_named_not_a_traceback(tmp_path, capsys, change, message):
    """Before: AttributeError or TypeError in the merge, the capacity figure or the sample identity (exit 3), or, for
    a list of endpoints, the check that no two variants share a server skipped."""
    d = folder(tmp_path, info={**INFO, **change})
    assert_cannot_judge(capsys, d, f"{d / 'run.json'}: {message}")
    assert report_main([str(d), "--out", str(tmp_path / "report")]) == 0  # the page of what can be read


def test_a_torn_last_line_is_not_dropped(tmp_path, capsys):
    # 48 whole rows, then a row cut mid-write (no newline): line 49
    text = lines(healthy())
    d = folder(tmp_path, text=text + lines(healthy(ids=[N]))[:40])
    assert_cannot_judge(
        capsys, d, f"{d / 'samples.jsonl'}:49: line 49 is torn (a write was killed); finish the run with resume=true"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 5 is not valid JSON (Expecting property name enclosed in double quotes)"),
        ("{}", "line 5 is an empty object"),
        ("null", "line 5 is null, not an object"),
        ('[1, "a"]', "line 5 is a list, not an object"),
        (json.dumps({"sample_id": "s2", "variant": "baseline"}), "line 5 has no score"),
        (json.dumps({**healthy()[4], "score": "1"}), "line 5 has score='1', not a number"),
    ],
    ids=["not-json", "empty-object", "null", "list", "no-score", "score-not-a-number"],
)
def test_a_corrupt_row_is_named_by_file_and_line(tmp_path, capsys, line, message):
    text = lines(healthy()).splitlines(keepends=True)
    text[4] = line + "\n"
    d = folder(tmp_path, text="".join(text))
    assert_cannot_judge(capsys, d, f"{d / 'samples.jsonl'}:5: {message}")


def test_read_rows_names_the_bad_line_and_keeps_cutting_a_torn_one(tmp_path):
    path = tmp_path / "samples.jsonl"
    whole = lines(healthy(ids=[0]))
    path.write_text(whole + '{"sample_id": "s1", "varia')
    assert [r["variant"] for r in read_rows(path)] == ["baseline", "snapkv@0.25"]  # dropped, the file kept
    assert path.read_text().endswith("varia")
    cut_torn(path)
    assert len(read_rows(path)) == 2 and path.read_text() == whole  # cut where the whole rows end
    for line, message in [
        ("null", "line 3 is null, not an object"),
        ("{}", "line 3 is an empty object"),
        ("[]", "line 3 is a list, not an object"),
        ('{"variant": "baseline"}', "line 3 has no sample_id"),
    ]:
        path.write_text(whole + line + "\n")
        for read in (read_rows, cut_torn):
            with pytest.raises(ConfigError, match=f"{path}:3: {message}"):
                read(path)


def test_resume_over_a_bad_row_is_one_line_exit_2(tmp_path):
    args = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", f"hydra.run.dir={tmp_path}"]
    assert run_cli(*args).returncode == 0
    rows = tmp_path / "samples.jsonl"
    rows.write_text(rows.read_text().splitlines(keepends=True)[0] + "null\n")
    result = run_cli(*args, "resume=true")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"evalkit: error: {rows}:2: line 2 is null, not an object: a row is a JSON object with sample_id, variant; "
        "the file was edited or corrupted: fix or delete that line, or move the file away to start the run afresh"
    ]


def test_the_reported_reproduction_exits_2(tmp_path):
    # tiny-random finds no needle: baseline 0.00, policy 0.00, and the gate used to say PASS with exit code 0
    args = ["model=tiny-random", "gate=default", "task.samples_per_cell=4", "task.context_lengths=[256]"]
    result = run_cli(*args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert "evalkit gate: CANNOT JUDGE" in result.stdout and "evalkit gate: PASS" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]  # above it, the progress bar
    assert last.startswith("evalkit: error: the gate cannot judge these records: the full-cache baseline scores 0.00")
    assert "Traceback" not in result.stderr
    assert json.loads((tmp_path / "verdict.json").read_text())["verdict"] == "CANNOT JUDGE"


def test_the_report_lists_the_problems_as_warnings_and_exits_0(tmp_path, capsys):
    d = folder(tmp_path, text=lines(healthy()) * 2)
    assert report_main([str(d), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert "evalkit report: warning: " in err and "48 rows repeat a (sample, variant)" in err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert md.index("## Warnings") < md.index("Runs:") and "48 rows repeat a (sample, variant)" in md
    assert "| snapkv@0.25 | 24 |" in md  # the tables count each (sample, variant) once
    weak = tmp_path / "weak"
    weak.mkdir()
    d = folder(weak, healthy(base=lambda i: 0.0, pol=lambda i: 0.0))
    assert report_main([str(d)]) == 0
    assert "the full-cache baseline scores 0.00" in (d / "report" / "report.md").read_text()


def test_output_folders(tmp_path, capsys):
    d = folder(tmp_path, healthy(ids=range(N_PASS)))
    out = tmp_path / "new" / "verdicts"  # does not exist yet: created
    code, stdout, _ = gate(capsys, d, "--out", str(out))
    assert code == 0 and (out / "verdict.json").exists() and (out / "report.md").exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for command in (report_main, main):
        assert command([str(d), "--out", str(a_file)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"evalkit: error: {a_file} is a file, not a folder: give --out a folder (it is created if missing)"
        ]


def test_a_bug_exits_3_and_ctrl_c_130(tmp_path, capsys, monkeypatch):
    d = folder(tmp_path)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(gating, "judge", boom)
    assert main([str(d)]) == 3
    assert "internal error" in capsys.readouterr().err

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gating, "judge", stop)
    assert main([str(d)]) == 130
    monkeypatch.setattr(report_module, "summarize", boom)
    assert report_main([str(d)]) == 3


@pytest.mark.parametrize(
    ("rows", "code", "status"),
    [
        (healthy(ids=range(N_PASS)), 0, "PASS"),
        (healthy(), 2, "INCONCLUSIVE"),
        (healthy() + healthy(), 2, "CANNOT JUDGE"),
    ],
    ids=["healthy", "too-few", "repeated"],
)
def test_a_sweep_that_cannot_be_judged_exits_2(tmp_path, capsys, monkeypatch, rows, code, status):
    job = tmp_path / "sweep" / "needle" / "m" / "snapkv"
    job.mkdir(parents=True)
    folder(job, rows)
    gate_node = compose_config("gate=default").gate
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}, "gate": gate_node})
    assert sweep.merge(cfg) == code
    verdict = json.loads((tmp_path / "sweep" / "verdict.json").read_text())["verdict"]
    assert verdict == status
    assert (tmp_path / "sweep" / "report" / "report.md").exists()


def test_a_bug_in_the_sweep_merge_exits_3(tmp_path, capsys, monkeypatch):
    (tmp_path / "sweep").mkdir()
    folder(tmp_path / "sweep")

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(gating, "judge", boom)
    cfg = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}, "gate": compose_config("gate=default").gate}
    )
    assert sweep.merge(cfg) == 3 and "internal error" in capsys.readouterr().err
