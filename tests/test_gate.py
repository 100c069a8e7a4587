"""Paired statistics on hand-made records with known answers, and the gate's verdicts."""

from __future__ import annotations

import json

import pytest
from scipy.stats import binomtest

from evalkit.cli.gate import load_thresholds, main
from evalkit.records.schema import flip_cause
from evalkit.records.summary import paired, summarize
from evalkit.stats import mcnemar_exact
from evalkit.thresholds import Thresholds
from tests.conftest import as_rows, as_written, drew, judge_rows, run_cli


def rows(base: list[float], pol: list[float], variant="snapkv@0.25", cell=None, kv=(25, 100), retained=None):
    out = []
    for i, (b, p) in enumerate(zip(base, pol, strict=True)):
        c = cell(i) if cell else {"depth": 0.5}
        flip = None if b == p else ("lost" if p < b else "gained")
        common = {
            "sample_id": str(i),
            "cell": c,
            "kv_bytes_baseline": kv[1],
            "peak_kv_bytes": kv[1],
            "baseline_score": b,
            "context_tokens": 100,
        }
        out.append(
            {
                **common,
                "variant": "baseline",
                "score": b,
                "flip": None,
                "kv_bytes": kv[1],
                "policy": {"name": "baseline"},
            }
        )
        out.append(
            {
                **common,
                "variant": variant,
                "score": p,
                "flip": flip,
                "kv_bytes": kv[0],
                "policy": {"name": variant.split("@")[0], "budget": 0.25},
                "evidence_retained_per_layer": retained(i) if retained else None,
            }
        )
    return as_written(out)


def test_paired_statistics_on_known_records():
    s = paired([1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 0, 1])
    assert (s["n"], s["lost"], s["gained"]) == (6, 2, 1)
    assert s["drop"] == pytest.approx(4 / 6 - 3 / 6)
    assert s["mcnemar_p"] == pytest.approx(binomtest(2, 3, 0.5).pvalue) == pytest.approx(1.0)
    assert mcnemar_exact(10, 0) == pytest.approx(2 * 0.5**10)
    assert mcnemar_exact(0, 0) == 1.0


def test_flips_are_classified_evicted_or_ignored():
    assert flip_cause({"flip": "lost", "evidence_retained_per_layer": [0.0, 0.2, 0.1]}) == "evicted"
    assert flip_cause({"flip": "lost", "evidence_retained_per_layer": [1.0, 0.9, 0.7]}) == "ignored"
    assert flip_cause({"flip": None, "evidence_retained_per_layer": [0.0]}) is None
    s = summarize(as_rows(rows([1, 1, 1], [0, 0, 1], retained=lambda i: [0.0] if i == 0 else [1.0])))
    assert s["snapkv@0.25"]["flip_causes"] == {"evicted": 1, "ignored": 1}


N = 74  # samples: the fewest a PASS with no loss needs by betting at the default margin (0.05) and confidence (0.95)


def test_gate_passes_a_faithful_variant():
    v = judge_rows(rows([1] * N, [1] * N), [], Thresholds())
    assert v.passed and v.reasons == [] and v.status == "PASS"


def test_gate_fails_with_every_reason_in_words():
    cell = lambda i: {"depth": 0.5 if i % 2 else 1.0}  # noqa: E731
    v = judge_rows(rows([1] * N, [0 if i % 2 else 1 for i in range(N)], cell=cell), [], Thresholds())
    assert v.status == "FAIL"
    text = "\n".join(v.reasons)
    assert "lower bound" in text and "shown over the 0.05 margin" in text and "flipped from right to wrong" in text
    # 37 wrong of 37 in cell depth=0.5: by betting a wealth over 2^37 / 4, shown below 0.5 after Holm over the cells
    assert "cell depth=0.5: accuracy 0.00 (baseline 1.00, n=37) shown below 0.5" in text and "depth=1.0" not in text


@pytest.mark.parametrize(
    ("records", "infos", "message"),
    [
        (rows([1] * N, [1] * N, kv=(100, 100)), [], "compression was asked but its KV bytes are 1.000x the full cache"),
        (
            rows([1] * N, [1] * N),
            [{"model": {"name": "m", "fingerprint": "a"}}, {"model": {"name": "m", "fingerprint": "b"}}],
            "the runs of model m used different weights",
        ),
        (rows([1] * N, [1] * N), [{"protocol": "query_aware"}, {"protocol": "query_agnostic"}], "differ in protocol"),
        (
            [{**r, "prefill_peak_tokens": 90, "prefill_bound_tokens": 80} for r in rows([1] * N, [1] * N)],
            [],
            "held 90 tokens in a layer, over its bound of 80",
        ),
    ],
    ids=["no-compression", "mixed-models", "mixed-protocols", "over-bound"],
)
def test_gate_fails_closed(records, infos, message):
    v = judge_rows(records, infos, Thresholds())
    assert not v.passed and v.status == "FAIL"
    assert any(message in r for r in v.reasons), v.reasons


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([r for r in rows([1] * N, [1] * N) if r["variant"] != "baseline"], "no baseline rows"),
        ([], "no rows"),
        ([r for r in rows([1] * 30, [1] * 30) if r["variant"] == "baseline"], "only baseline rows (30 samples)"),
        (rows([0] * 30, [0] * 30), "the full-cache baseline scores 0.00 on this task"),
    ],
    ids=["no-baseline", "empty", "no-policy", "weak-baseline"],
)
def test_gate_cannot_judge_degenerate_records(records, message):
    v = judge_rows(records, [], Thresholds())
    assert not v.passed and v.status == "CANNOT JUDGE"
    assert any(message in r for r in v.reasons), v.reasons


def write_run(folder, records, run_id="r1"):
    folder.mkdir(parents=True)
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "run.json").write_text(json.dumps(drew(run_info(run_id), records)))
    return folder


def test_a_policy_that_compresses_by_a_threshold_is_held_to_min_compression():
    """simlayerkv, dms and think run at budget 1.0 and compress by a threshold, lazy layers or pruned channels: before,
    the gate read budget 1.0 as "no compression asked" and PASSed simlayerkv keeping every token (its n_recent over
    the context). Each policy says so of itself (KVPolicy.compresses, each row's compression_asked). A budget of 1
    token asks (it read as 1.0 before); 1.0 does not, nor the full cache; controls: the same rows not asked PASS."""
    from evalkit.policies.dms import DMS
    from evalkit.policies.none import FullCache
    from evalkit.policies.simlayerkv import SimLayerKV
    from evalkit.policies.snapkv import SnapKV
    from evalkit.policies.think import ThinK

    assert SimLayerKV().compresses() and DMS(inner=SnapKV()).compresses() and ThinK(inner=FullCache()).compresses()
    assert not ThinK(inner=FullCache(), channels=0.0).compresses() and not FullCache().compresses()
    assert SnapKV(budget=1).compresses() and SnapKV(budget=0.5).compresses() and not SnapKV(budget=1.0).compresses()
    full = rows([1] * N, [1] * N, variant="simlayerkv@1.0", kv=(100, 100))
    for r in full:
        r["policy"]["budget"] = 1.0
    asked = [{**r, "compression_asked": r["variant"] != "baseline"} for r in full]
    v = judge_rows(asked, [], Thresholds())
    message = "simlayerkv@1.0: compression was asked but its KV bytes are 1.000x"
    assert v.status == "FAIL" and any(message in r for r in v.reasons), v.reasons
    assert judge_rows([{**r, "compression_asked": False} for r in full], [], Thresholds()).status == "PASS"


def test_one_server_under_two_spellings_is_one_server():
    """Before: the same server as http://127.0.0.1:18777/v1 and http://localhost:18777/v1 (or 127.0.0.2, 0.0.0.0,
    ::1, /./v1, /v1/../v1) passed as two, and a run compared the server with itself PASSed on declared bytes.
    Controls: another port, another host, another path are other servers."""
    from evalkit.records.checks import shared_endpoints

    base = "http://127.0.0.1:18777/v1"
    for other in ("http://localhost:18777/v1/", "http://127.0.0.2:18777/v1", "http://0.0.0.0:18777/./v1",
                  "http://[::1]:18777/v1", "HTTP://LOCALHOST:18777/v1/../v1"):  # fmt: skip
        assert shared_endpoints({"baseline": base, "q4_0": other}) == (
            f"endpoints 'baseline' and 'q4_0' are the same server ({other})"
        )
    for other in ("http://127.0.0.1:18778/v1", "http://10.0.0.1:18777/v1", "http://127.0.0.1:18777/v2"):
        assert shared_endpoints({"baseline": base, "q4_0": other}) is None
    assert shared_endpoints({"a": "http://10.0.0.1/v1", "b": "http://10.0.0.1:80/v1"}) is not None


def test_a_pass_at_thresholds_other_than_the_defaults_says_so_first(tmp_path, capsys):
    """Before: `max_drop: 0.5` from a gate file PASSed with "Every threshold is shown to hold", the values only in
    verdict.json. Control: the same rows at the defaults, a plain PASS."""
    good = write_run(tmp_path / "good", rows([1] * N, [1] * N))
    assert main([str(good), "--out", str(tmp_path / "default")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[0] == "evalkit gate: PASS (look 1 of this run)"
    (tmp_path / "loose.yaml").write_text("max_drop: 0.5\nmin_baseline_accuracy: null\n")
    summary = tmp_path / "step.md"
    loose = ["--gate", str(tmp_path / "loose.yaml"), "--out", str(tmp_path / "loose"), "--summary", str(summary)]
    assert main([str(good), *loose]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "evalkit gate: PASS at thresholds other than the defaults (2 changed, below) (look 2 of this run)"
    assert out[1] == (
        "  - note: thresholds other than the defaults (conf/gate/default.yaml): max_drop=0.5 (default 0.05); "
        "min_baseline_accuracy=None (default 0.5)"
    )
    report = (tmp_path / "loose" / "report.md").read_text()
    assert report.startswith("# evalkit gate: PASS at thresholds other than the defaults") and "max_drop=0.5" in report
    verdict = json.loads((tmp_path / "loose" / "verdict.json").read_text())
    assert verdict["non_default_thresholds"] == [
        "max_drop=0.5 (default 0.05)",
        "min_baseline_accuracy=None (default 0.5)",
    ]
    assert json.loads((tmp_path / "default" / "verdict.json").read_text())["non_default_thresholds"] == []
    assert summary.read_text().splitlines()[2] == (
        "> thresholds other than the defaults: max_drop=0.5 (default 0.05); min_baseline_accuracy=None (default 0.5)"
    )


def run_info(run_id: str) -> dict:
    """What the gate needs of a run.json: the config, the model fingerprint and the library versions."""
    return {
        "run_id": run_id,
        "config": {"task": {"name": "needle"}, "seed": 0},
        "model": {"name": "m", "fingerprint": "sha256:0"},
        "versions": {"torch": "2.13.0", "transformers": "5.24.0", "evalkit": "0.1.0"},
    }


def test_gate_command_line_writes_verdict_and_report_and_exits_by_verdict(tmp_path):
    good = write_run(tmp_path / "good", rows([1] * N, [1] * N))
    bad = write_run(tmp_path / "bad", rows([1] * N, [0] * N))
    small = write_run(tmp_path / "small", rows([1] * 20, [1] * 20))
    assert main([str(good)]) == 0
    assert json.loads((good / "verdict.json").read_text())["verdict"] == "PASS"
    assert main([str(bad)]) == 1
    assert "FAIL" in (bad / "report.md").read_text()
    assert main([str(small)]) == 2
    assert json.loads((small / "verdict.json").read_text())["verdict"] == "INCONCLUSIVE"
    assert main([str(tmp_path / "missing")]) == 2
    assert main([str(good), "--gate", "nope"]) == 2
    assert load_thresholds("default").max_drop == 0.05
    assert load_thresholds("default").min_baseline_accuracy == 0.5


def test_gate_after_a_run_sets_the_exit_code(tmp_path):
    # tiny-random cannot find a needle (its baseline scores 0): the baseline check is switched off to test the FAIL
    args = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", "policy.budget=0.5"]
    result = run_cli(*args, "gate=default", "gate.min_baseline_accuracy=null", f"hydra.run.dir={tmp_path}")
    # one sample cannot show anything: INCONCLUSIVE, exit 2, with the samples a PASS would need at the next look,
    # the anytime-valid one (74 with no loss: tests/test_stats.py, lossless_betting_count)
    assert result.returncode == 2, result.stderr
    assert "evalkit gate: INCONCLUSIVE (look 1 of this run)" in result.stdout
    assert "74 samples would show it with about 80% chance at look 2" in result.stderr
    assert "add at least 73" in result.stderr
    assert (tmp_path / "verdict.json").exists() and (tmp_path / "report.md").exists()


def test_capacity_counts_sequences_that_fit_after_the_weights():
    t = Thresholds(capacity={"gpu_gib": 1, "context": 1000})
    v = judge_rows(rows([1] * N, [1] * N, kv=(25, 100)), [{"model": {"weights_bytes": 2**29}}], t)
    assert v.capacity["baseline"]["kv_bytes_per_token"] == 1.0
    assert v.capacity["baseline"]["sequences"] == 2**29 // 1000
    assert v.capacity["snapkv@0.25"]["sequences"] == 2**29 // 250  # a quarter of the bytes: four times the sequences
    assert v.variants["snapkv@0.25"]["nominal_budget"] == 0.25
    assert v.variants["snapkv@0.25"]["peak_prefill_kv_bytes"] == 100
