"""Each policy against a plain reference that materialises the attention matrix (transformers' eager attention
with output_attentions), on small inputs: kept indices must be equal, exactly."""

from __future__ import annotations

import pytest
import torch

from evalkit.attention import attention_mass, causal_tail_mask
from evalkit.cache import compress, share
from evalkit.engine import greedy, prefill
from evalkit.errors import ConfigError
from evalkit.policies.pyramidkv import pyramid
from tests.conftest import CTX, QUESTION, by_kv_head, compressed, policy, pool_by_hand, top_k

BUDGET = 24


@pytest.fixture(scope="module")
def reference(eager, ids):
    with torch.inference_mode():
        out = eager(input_ids=ids[:, :CTX], output_attentions=True, use_cache=True)
    return out.attentions, [layer.keys for layer in out.past_key_values.layers]  # (B, Hq, T, T), (B, Hkv, T, D)


def reference_keep(name, pol, attn, keys, k) -> torch.Tensor:
    hkv = keys.shape[1]
    pos = torch.arange(CTX).expand(1, hkv, CTX)
    if name == "h2o":
        return top_k(by_kv_head(attn.sum(dim=2), hkv), pos >= CTX - int(pol.recent * k), k)
    if name in ("snapkv", "pyramidkv"):
        # The paper's code: the window queries' attention on the prefix only, summed, pooled; the window kept.
        prefix = CTX - pol.window
        win = by_kv_head(attn[:, :, -pol.window :, :prefix].sum(dim=2), hkv)  # (B, Hkv, prefix)
        pooled = pool_by_hand(win, pol.kernel, pol.pooling)
        return top_k(torch.cat([pooled, pooled.new_zeros(1, hkv, pol.window)], -1), pos >= prefix, k)
    if name == "knorm":
        return top_k(-keys.norm(dim=-1), torch.zeros_like(pos, dtype=torch.bool), k)
    if name == "streaming_llm":
        return top_k(pos.float(), pos < pol.n_sink, k)
    raise AssertionError(name)


CASES = [("h2o", {}), ("knorm", {}), ("streaming_llm", {})] + [
    (name, {"pooling": pooling}) for name in ("snapkv", "pyramidkv") for pooling in ("avg", "max")
]


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{o.get('pooling', '')}".strip("-") for n, o in CASES])
def test_kept_indices_equal_the_naive_reference(tiny, ids, reference, name, options):
    pol = policy(name, BUDGET, **options)
    _, cache = compressed(tiny.model, ids, pol)
    attentions, keys = reference
    ks = pol.keep_per_layer(CTX, len(keys))
    for layer_idx, (attn, k) in enumerate(zip(attentions, keys, strict=True)):
        want = reference_keep(name, pol, attn, k, ks[layer_idx])
        assert torch.equal(cache.layers[layer_idx].positions, want), f"layer {layer_idx}"


@pytest.mark.parametrize("chunk_elements", [1, 97, 1 << 24], ids=["one-query-chunks", "odd-chunks", "one-chunk"])
def test_chunked_attention_mass_equals_the_materialised_one(reference, chunk_elements):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 10, 16, generator=g), torch.randn(1, 2, 25, 16, generator=g)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(~causal_tail_mask(10, 25, q.device), float("-inf"))
    want = by_kv_head(scores.softmax(-1).sum(dim=2), 2)
    torch.testing.assert_close(attention_mass(q, k, 0.25, chunk_elements), want, rtol=1e-5, atol=1e-6)


def test_h2o_running_mass_adds_every_new_query_attention(tiny, eager, ids):
    pol = policy("h2o", BUDGET)
    full, obs = prefill(tiny.model, ids[:, :CTX], [pol])
    observed, plain = compress(full, pol, obs), compress(full, pol, obs)
    before = [layer.state["attn_mass"].clone() for layer in observed.layers]
    question = ids[:, CTX:]
    greedy(tiny.model, observed, question, 1, set())  # one forward: the question chunk
    with torch.inference_mode():
        attn = eager(input_ids=question, cache=plain, use_cache=True, output_attentions=True).attentions
    for layer, old, a in zip(observed.layers, before, attn, strict=True):
        hkv = layer.keys.shape[1]
        grown = torch.cat([old, old.new_zeros(1, hkv, QUESTION)], dim=-1)
        torch.testing.assert_close(layer.state["attn_mass"], grown + by_kv_head(a.sum(dim=2), hkv))


def test_h2o_prefill_mass_is_observed_under_sdpa_not_eager(tiny, ids):
    assert tiny.model.config._attn_implementation == "evalkit_sdpa"
    _, obs = prefill(tiny.model, ids[:, :CTX], [policy("h2o", BUDGET)])
    assert set(obs) == set(range(tiny.model.config.num_hidden_layers))
    assert all(o["attn_mass"].shape == (1, 2, CTX) for o in obs.values())
    # every query's attention sums to one, and the mass sums over queries and over the 2 heads of each group
    total = sum(o["attn_mass"].sum() for o in obs.values())
    torch.testing.assert_close(total, torch.tensor(float(CTX * 4 * len(obs))))


def test_pyramid_budgets_follow_the_reference_formula_with_its_fallback():
    """By hand from the reference (KVCache-Factory / kvpress): low = k/beta, high = 2k - low, high capped at the
    prompt less the window (then low = 2k - high), uniform k when a layer would get fewer than the window."""
    # k=100, beta=4: low 25, high 175, step 37.5 -> 175, 137.5, 100, 62.5, 25 (ties round to even)
    assert pyramid(100, 5, 4, window=8, seen=400) == [175, 138, 100, 62, 25]
    # k=300 of 400 seen: high 585 capped at 392, low 208 -> 392, 300, 208
    assert pyramid(300, 3, 20, window=8, seen=400) == [392, 300, 208]
    # k=100, beta=20: low 5 is below the window of 8 -> the reference falls back to uniform SnapKV budgets
    assert pyramid(100, 4, 20, window=8, seen=400) == [100] * 4
    # the measurement: 874 tokens, window 32, a quarter kept -> fallback; half kept -> a pyramid
    assert pyramid(219, 30, 20, window=32, seen=874) == [219] * 30
    half = pyramid(437, 30, 20, window=32, seen=874)
    assert (half[0], half[-1], sum(half)) == (842, 32, 30 * 437)


def test_policy_config_errors():
    with pytest.raises(ConfigError, match="decode=false"):
        policy("pyramidkv", 0.25, decode=True).validate(1024)
    with pytest.raises(ConfigError, match="pooling"):
        policy("snapkv", 0.25, pooling="median").validate(1024)
    with pytest.raises(ConfigError, match="odd"):
        policy("snapkv", 0.25, kernel=4).validate(1024)
    with pytest.raises(ConfigError, match="fewer than the 9"):
        policy("snapkv", 8).validate(1024)  # window 8 + 1


def test_baseline_shares_the_prefilled_tensors(tiny, ids):
    full, _ = prefill(tiny.model, ids[:, :CTX])
    assert share(full).layers[0].keys.data_ptr() == full.layers[0].keys.data_ptr()


def test_h2o_normalize_divides_the_mass_by_the_queries_that_saw_each_key():
    """Six tokens seen, masses chosen by hand; keys at positions 0..5 were seen by 6, 5, 4, 3, 2, 1 queries.
    Raw mass (the paper): 3.0, 1.0, 0.9, 0.8, 0.5, 0.2 -> the top two are positions 0 and 1.
    Normalized (kvpress's observed attention): 0.5, 0.2, 0.225, 0.267, 0.25, 0.2 -> positions 0 and 3."""
    from evalkit.policies import LayerView
    from evalkit.policies.h2o import H2O

    positions = torch.arange(6).view(1, 1, 6)
    mass = torch.tensor([3.0, 1.0, 0.9, 0.8, 0.5, 0.2]).view(1, 1, 6)
    view = LayerView(0, 1, 6, torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 4), positions, {"attn_mass": mass})
    assert H2O(budget=2, recent=0.0).select(view, 2).tolist() == [[[0, 1]]]
    assert H2O(budget=2, recent=0.0, normalize=True).select(view, 2).tolist() == [[[0, 3]]]
