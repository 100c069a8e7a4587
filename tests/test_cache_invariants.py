"""DESIGN.md section 4 invariants 1-4 for every policy in conf/policy, on the tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from evalkit.cache import EvictingLayer, compress, enforce, held_per_layer, kv_bytes, share
from evalkit.config import options
from evalkit.engine import greedy, prefill
from tests.conftest import compose_config

POLICIES = options("policy")
CTX, QUESTION, STEPS = 96, 7, 6


def policy(name: str, budget) -> object:
    cfg = compose_config(f"policy={name}", f"++policy.budget={budget}")
    return instantiate(cfg.policy, _convert_="all")


@pytest.fixture(scope="module")
def ids(tiny):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, len(tiny.tokenizer), (1, CTX + QUESTION), generator=g)


def run(model, ids, pol=None, steps=STEPS, after=None):
    full = prefill(model, ids[:, :CTX])
    cache = share(full) if pol is None else compress(full, pol)
    hook = after or ((lambda: enforce(cache, pol)) if pol is not None and pol.decode else (lambda: None))
    return greedy(model, cache, ids[:, CTX:], steps, set(), hook), cache


@pytest.mark.parametrize("name", POLICIES)
def test_identity_full_budget_reproduces_full_cache_logits(tiny, ids, name):
    base, _ = run(tiny.model, ids)
    got, _ = run(tiny.model, ids, policy(name, 1.0))
    assert got.tokens == base.tokens
    for a, b in zip(got.logits, base.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_baseline_matches_one_shot_forward(tiny, ids):
    base, _ = run(tiny.model, ids)
    full_ids = torch.cat([ids, torch.tensor([base.tokens[:-1]])], dim=1)
    with torch.inference_mode():
        ref = tiny.model(full_ids).logits[0, CTX + QUESTION - 1 :]
    for i, step in enumerate(base.logits):
        torch.testing.assert_close(step, ref[i], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", [p for p in POLICIES if p != "none"])
def test_positions_after_eviction_match_masked_full_attention(tiny, ids, name):
    """Evicting tokens must equal attending over the whole sequence with those tokens masked out: RoPE positions
    stay absolute, and the question tokens appended in one chunk stay causal among themselves."""
    pol = policy(name, 0.5)
    pol.decode = False
    full = prefill(tiny.model, ids[:, :CTX])
    cache = compress(full, pol)
    layer = next(layer for layer in cache.layers if isinstance(layer, EvictingLayer))
    kept = layer.positions[0, 0]
    assert all(torch.equal(lay.positions, layer.positions) for lay in cache.layers), "test assumes one keep-set"
    with torch.inference_mode():
        got = tiny.model(input_ids=ids[:, CTX:], cache=cache, use_cache=True).logits[0]
    n = CTX + QUESTION
    mask = torch.ones(n, n).tril().bool()
    evicted = torch.ones(CTX, dtype=torch.bool)
    evicted[kept] = False
    mask[CTX:, :CTX] &= ~evicted
    with torch.inference_mode():
        ref = tiny.model(input_ids=ids, attention_mask=mask[None, None]).logits[0, CTX:]
    assert evicted.any()
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("budget", [0.25, 40])
def test_budget_exact_per_layer_and_head_at_prefill_end_and_every_decode_step(tiny, ids, name, budget):
    pol = policy(name, budget)
    seen_held = []

    def after():
        enforce(cache, pol)
        seen_held.append((cache.get_seq_length(), held_per_layer(cache)))

    full = prefill(tiny.model, ids[:, :CTX])
    cache = compress(full, pol)
    assert held_per_layer(cache) == [pol.target(CTX)] * len(cache.layers)
    greedy(tiny.model, cache, ids[:, CTX:], STEPS, set(), after if pol.decode else lambda: None)
    if not pol.decode:
        return
    assert len(seen_held) == STEPS
    for seen, held in seen_held:
        assert held == [pol.target(seen)] * len(cache.layers)
        assert all(layer.keys.shape[-2] == layer.positions.shape[-1] for layer in cache.layers)


def test_fraction_and_token_budgets_have_their_meaning(tiny):
    assert policy("streaming_llm", 0.25).target(100) == 25
    assert policy("streaming_llm", 0.25).target(101) == 26  # ceil: never below the fraction
    assert policy("streaming_llm", 40).target(100) == 40
    assert policy("streaming_llm", 40).target(30) == 30
    assert policy("none", 0.1).target(100) == 100


def test_streaming_llm_keeps_sinks_and_recent_window_during_decode(tiny, ids):
    pol = policy("streaming_llm", 24)
    dec, cache = run(tiny.model, ids, pol)
    seen = cache.get_seq_length()
    assert seen == CTX + QUESTION + STEPS - 1  # the last generated token is never fed back
    for layer in cache.layers:
        expected = list(range(pol.n_sink)) + list(range(seen - (24 - pol.n_sink), seen))
        for head in layer.positions[0]:
            assert head.tolist() == expected


def test_kv_bytes_are_the_held_tensors(tiny, ids):
    cfg = tiny.model.config
    full = prefill(tiny.model, ids[:, :CTX])
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # float32
    assert kv_bytes(full) == per_token * CTX
    pol = policy("streaming_llm", 0.25)
    compressed = compress(full, pol)
    assert kv_bytes(compressed) == per_token * pol.target(CTX)
    assert kv_bytes(full) == per_token * CTX, "compressing must not modify the full cache"


def test_seq_length_reports_tokens_seen_while_masks_use_tokens_held(tiny, ids):
    full = prefill(tiny.model, ids[:, :CTX])
    cache = compress(full, policy("streaming_llm", 32))
    assert cache.get_seq_length() == CTX
    assert cache.get_mask_sizes(5, 0) == (32 + 5, CTX - 32)
