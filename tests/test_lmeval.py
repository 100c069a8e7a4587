"""lm-eval integration on the tiny random model with the bundled offline task."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="pip install 'lm-eval>=0.4.9,<0.5' for the lm-eval integration")

from evalkit import lmeval  # noqa: E402
from evalkit.records import read_rows  # noqa: E402
from tests.conftest import ROOT, run_cli  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def request(args, doc_id=0):
    return SimpleNamespace(args=args, task_name="t", doc_id=doc_id)


def lm_for(tiny, variant):
    lm = lmeval.EvalkitLM(loaded=tiny)
    (lm.variant,) = lmeval.parse_variants(lmeval.OmegaConf.create({"seed": 0, "variants": [variant]}))
    return lm


def test_loglikelihood_equals_the_full_model_at_full_budget(tiny):
    lm = lm_for(tiny, "snapkv@1.0")
    context, continuation = "The cat sat on the", " mat today"
    (got,) = lm.loglikelihood([request((context, continuation))])
    ctx = tiny.tokenizer(context).input_ids
    whole = tiny.tokenizer(context + continuation).input_ids
    with torch.inference_mode():
        logp = tiny.model(torch.tensor([whole])).logits[0].log_softmax(-1)
    want = sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
    assert got[0] == pytest.approx(want, abs=1e-4)
    assert lm.baseline_answers[lmeval._key("loglikelihood", (context, continuation))][0] == pytest.approx(
        want, abs=1e-4
    )


def test_one_compressed_context_serves_every_choice(tiny, monkeypatch):
    calls = []
    real = lmeval.prefill
    monkeypatch.setattr(lmeval, "prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = lm_for(tiny, "knorm@0.5")
    context = "word " * 60
    out = lm.loglikelihood([request((context, f" choice {c}")) for c in "abcd"])
    assert len(out) == 4 and len(calls) == 1
    assert lm.kv[("t", 0)]["kv_bytes"] < lm.kv[("t", 0)]["kv_bytes_baseline"]


def test_generate_until_and_rolling_run_baseline_beside_the_variant(tiny):
    lm = lm_for(tiny, "streaming_llm@16")
    (text,) = lm.generate_until([request(("word " * 40, {"until": ["\n"], "max_gen_toks": 5}))])
    assert isinstance(text, str) and "\n" not in text
    (total,) = lm.loglikelihood_rolling([request(("some text " * 20,))])
    base = lm.baseline_answers[lmeval._key("loglikelihood_rolling", ("some text " * 20,))]
    assert total < 0 and base < 0 and total != base
    replay = lm.baseline()
    assert replay.loglikelihood_rolling([request(("some text " * 20,))]) == [base]


def test_simple_evaluate_scores_variant_and_replayed_baseline(tiny):
    from lm_eval import simple_evaluate

    lm = lm_for(tiny, "none@1.0")
    kwargs = {"tasks": ["evalkit_recall"], "task_manager": lmeval.task_manager(), "limit": 3, "bootstrap_iters": 0}
    run = simple_evaluate(model=lm, **kwargs)
    base = simple_evaluate(model=lm.baseline(), **kwargs)
    assert run["results"]["evalkit_recall"]["acc,none"] == base["results"]["evalkit_recall"]["acc,none"]
    assert [d["resps"] for d in run["samples"]["evalkit_recall"]] == [
        d["resps"] for d in base["samples"]["evalkit_recall"]
    ]


def test_evalkit_cli_runs_lm_eval_tasks_with_one_row_per_document(tmp_path):
    result = run_cli(
        "model=tiny-random",
        "task=lm_eval",
        "task.limit=3",
        "variants=[snapkv@0.5]",
        f"hydra.run.dir={tmp_path}",
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_rows(tmp_path / "samples.jsonl")
    assert sorted((r["sample_id"], r["variant"]) for r in rows) == sorted(
        (f"evalkit_recall/{i}", v) for i in range(3) for v in ("baseline", "snapkv@0.5")
    )
    assert all(r["metric"] == "acc" and r["kv_bytes"] for r in rows)
    results = json.loads((tmp_path / "lm_eval_results.json").read_text())
    assert set(results) == {"baseline", "snapkv@0.5"}


def test_lm_eval_command_line_knows_the_evalkit_model(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "evalkit.lmeval",
            "--model",
            "evalkit",
            "--model_args",
            "model=tiny-random,variant=snapkv@0.5",
            "--tasks",
            "evalkit_recall",
            "--limit",
            "2",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "evalkit_recall" in out.stdout and "acc" in out.stdout


def test_unknown_lm_eval_task_is_a_config_error(tmp_path):
    result = run_cli(
        "model=hf",
        "model.name_or_path=/nonexistent",
        "model.max_context=4096",
        "task=lm_eval",
        "task.tasks=[evalkit_recal]",
        f"hydra.run.dir={tmp_path}",
        env={"HF_DATASETS_OFFLINE": "1"},
    )
    assert result.returncode == 2
    assert "lm-eval knows no task 'evalkit_recal'; did you mean evalkit_recall" in result.stderr


def test_lm_eval_command_line_keeps_the_exit_code_contract():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "evalkit.lmeval",
            "run",
            "--model",
            "evalkit",
            "--model_args",
            "model=tiny-random",
            "--tasks",
            "no_such_task_xyz",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "evalkit: error: lm-eval: Tasks not found: no_such_task_xyz"
