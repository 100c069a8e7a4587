"""Hybrid models (Gemma 3): policies evict in global layers; sliding-window layers keep their own bound."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers.cache_utils import DynamicSlidingWindowLayer

from evalkit.attention import sdpa
from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.engine.engine import run_sample
from evalkit.kv.cache import EvictingLayer, kv_bytes
from evalkit.kv.variant import Variant
from evalkit.tasks.prompt import Prompt
from tests.conftest import ROOT, policy

CTX = 80


@pytest.fixture(scope="module")
def gemma():
    return models.load(model_spec(OmegaConf.load(ROOT / "conf" / "model" / "tiny-random-gemma3.yaml")), "cpu")


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(0)
    return Prompt(torch.randint(3, 200, (1, CTX + 6), generator=g), CTX, list(range(30, 36)), "query_agnostic")


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "snapkv", "pyramidkv", "knorm", "random"])
def test_eviction_applies_to_global_layers_only_and_bytes_cover_both(gemma, prompt, name):
    cfg = gemma.model.config
    pol = policy(name, 0.25)
    baseline, (out,) = run_sample(gemma.model, prompt, [Variant(pol)], 4, set())
    # By hand: layers sliding, sliding, global, sliding (conf/model/tiny-random-gemma3.yaml). A sliding layer of a
    # 16-token window holds its last 15 tokens (transformers' DynamicSlidingWindowLayer), whatever the policy; the
    # one global layer holds ceil(0.25 * 80) = 20 under every policy (PyramidKV over one evicting layer has no
    # pyramid to build: the reference formula's uniform k).
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert cfg.sliding_window == 16
    expected = [15, 15, 20, 15]
    per_layer_token = 2 * 2 * 16 * 4  # keys and values x 2 KV heads x head_dim 16 x float32
    assert out.tokens_held == expected
    assert baseline.tokens_held == [15, 15, CTX, 15]
    assert out.kv_bytes == per_layer_token * sum(expected)
    assert baseline.kv_bytes == per_layer_token * sum(baseline.tokens_held)
    # the evidence (positions 30-35) is outside every sliding window, so only global layers can hold it
    assert [r for r, t in zip(baseline.evidence_retained, cfg.layer_types, strict=True) if t != "full_attention"] == [
        0.0
    ] * 3


def test_hybrid_cache_layers_keep_their_types(gemma, prompt):
    from evalkit.engine.engine import prefill
    from evalkit.kv.cache import compress

    pol = policy("snapkv", 0.25)
    full, obs = prefill(gemma.model, prompt.ids[:, :CTX], [pol])
    assert set(obs) == {2}, "observations are recorded for the global layer only"
    cache = compress(full, pol, obs)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer] * 2 + [EvictingLayer, DynamicSlidingWindowLayer]
    assert kv_bytes(cache) < kv_bytes(full)


def test_identity_on_the_hybrid_model(gemma, prompt):
    baseline, outs = run_sample(gemma.model, prompt, [Variant(policy(n, 1.0)) for n in ("snapkv", "h2o")], 5, set())
    for out in outs:
        assert out.tokens == baseline.tokens
        for a, b in zip(out.logits, baseline.logits, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["streaming_llm", "h2o", "snapkv"])
def test_chunked_prefill_on_hybrid_layers(gemma, prompt, name):
    """Chunks through sliding-window and evicting global layers: keeping everything matches one shot; a budget
    bounds the global layers by budget + chunk while the sliding layers keep their window."""
    keep_all, chunked = Variant(policy(name, 1.0), chunk=16), Variant(policy(name, 24), chunk=16)
    baseline, (same, bounded) = run_sample(gemma.model, prompt, [keep_all, chunked], 4, set())
    assert same.tokens == baseline.tokens
    for a, b in zip(baseline.logits, same.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert bounded.tokens_held == [15, 15, 24, 15]  # the 24 tokens asked in the global layer, 15 in a sliding one
    assert 24 < bounded.prefill_peak_tokens <= 24 + 16  # over the evicting (global) layers


def test_pyramid_spreads_over_the_global_layers_only():
    """Two global layers among four: a pyramid at half of 80 tokens (k=40, beta=2, window 8) is, by the reference
    formula, low = 40/2 = 20 and high = 2*40 - 20 = 60 over the two global layers: 60 then 20, the same 80 tokens in
    all as SnapKV's 40 + 40. Spread over all four layers it would give the globals 47 and 20."""
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny-random-gemma3.yaml")
    cfg.config.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    two = models.load(model_spec(cfg), "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (1, CTX + 6), generator=g)
    _, (pyr, snap) = run_sample(
        two.model,
        Prompt(ids, CTX, [], "query_agnostic"),
        [Variant(policy("pyramidkv", 0.5, beta=2)), Variant(policy("snapkv", 0.5))],
        2,
        set(),
    )
    window = cfg.config.sliding_window - 1
    assert pyr.tokens_held == [window, 60, window, 20]
    assert snap.tokens_held == [window, 40, window, 40]


def sliding_mask(t: int, window: int) -> torch.Tensor:
    """Gemma 3's sliding mask written out by hand: query i attends keys i - window + 1 .. i."""
    i = torch.arange(t)
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window))[None, None]


def test_bands_read_the_window_off_the_mask():
    # By hand, window 16, blocks of 8 queries: block a..a+7 attends keys a - 15 .. a + 7
    assert sdpa.bands(sliding_mask(40, 16), 16) == [
        (0, 8, 0, 8),
        (8, 16, 0, 16),
        (16, 24, 1, 24),
        (24, 32, 9, 32),
        (32, 40, 17, 40),
    ]
    # queries that are the last 16 of 40 keys (a block of KVzip's pass): queries 24..31 attend keys 9..31
    assert sdpa.bands(sliding_mask(40, 16)[..., 24:, :], 16) == [(0, 8, 9, 32), (8, 16, 17, 40)]
    # a causal mask is no band: a block whose rows attend keys before a - 15 (here from a = 16) is given every key,
    # so the output stays SDPA's
    i = torch.arange(24)
    causal = (i[None, :] <= i[:, None])[None, None]
    assert sdpa.bands(causal, 16) == [(0, 8, 0, 8), (8, 16, 0, 16), (16, 24, 0, 24)]


def test_sliding_layers_prefill_band_by_band_with_sdpas_logits(gemma, monkeypatch):
    """A one-shot prefill of 200 tokens (12 windows of 16) takes the banded path in the 3 sliding layers, and its
    logits are those of SDPA over the whole mask, up to float rounding."""
    ids = torch.randint(3, 200, (1, 200), generator=torch.Generator().manual_seed(1))
    calls = []
    real = sdpa.bands
    monkeypatch.setattr(sdpa, "bands", lambda mask, window: calls.append(window) or real(mask, window))
    with torch.no_grad():
        banded = gemma.model(ids, use_cache=False).logits
    assert calls == [16, 16, 16]  # layers 0, 1 and 3 slide; layer 2 is global
    monkeypatch.setattr(sdpa, "BANDED_FROM", 10**9)
    with torch.no_grad():
        whole = gemma.model(ids, use_cache=False).logits
    torch.testing.assert_close(banded, whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(banded.argmax(-1), whole.argmax(-1))
