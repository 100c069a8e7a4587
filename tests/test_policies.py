"""Each policy against references written from its paper's definition and code, none of evalkit's helpers: on the
tiny model, a plain reference that materialises the attention matrix (transformers' eager attention with
output_attentions), whose top set the kept tokens must be (ties among equal scores aside); and hand-built layers
whose scores can be worked out by hand, with the tokens kept written out."""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.attention.fused import attention_mass
from evalkit.attention.observation import AttentionMass, Window, WindowQueries
from evalkit.attention.sdpa import causal_tail_mask
from evalkit.engine.engine import greedy, prefill
from evalkit.errors import ConfigError
from evalkit.kv.cache import compress, share
from evalkit.policies.pyramidkv import pyramid
from tests.conftest import CTX, QUESTION, by_kv_head, compressed, policy, pool_by_hand

BUDGET = 24


@pytest.fixture(scope="module")
def reference(eager, ids):
    with torch.inference_mode():
        out = eager(input_ids=ids[:, :CTX], output_attentions=True, use_cache=True)
    return out.attentions, [layer.keys for layer in out.past_key_values.layers]  # (B, Hq, T, T), (B, Hkv, T, D)


def reference_choice(name, pol, attn, keys, k) -> tuple[torch.Tensor, range, range]:
    """Written from each paper's definition (and its code) over the eager model's attention matrices (B, Hq, T, T)
    and keys (B, Hkv, T, D), with none of evalkit's helpers: (scores (1, Hkv, n) of the candidate positions, the
    candidate positions, the positions every head keeps whatever the scores). A head keeps those, and the
    k - len(always) candidates of highest score."""
    hkv = keys.shape[1]
    if name == "h2o":
        # H2O's code: int(recent_ratio * budget) most recent tokens, the rest of the budget the heavy hitters, the
        # tokens of largest attention received, summed over every query (and the query heads of the KV group).
        recent = int(0.5 * k)
        return by_kv_head(attn.sum(dim=2), hkv)[..., : CTX - recent], range(CTX - recent), range(CTX - recent, CTX)
    if name in ("snapkv", "pyramidkv"):
        # SnapKV's code: the last `window` queries' attention (softmax over every key) on the prefix before the
        # window, summed over those queries, pooled along the prefix only; top (k - window) of it, plus the window.
        prefix = CTX - WINDOW
        win = by_kv_head(attn[:, :, -WINDOW:, :prefix].sum(dim=2), hkv)  # (1, Hkv, prefix)
        # kernel 5: the SnapKV code's and conf/policy's default
        return pool_by_hand(win, 5, pol.pooling), range(prefix), range(prefix, CTX)
    if name == "knorm":  # the k keys of lowest L2 norm
        return -keys.norm(dim=-1), range(CTX), range(0)
    if name == "streaming_llm":  # the 4 sink tokens, then the most recent
        return torch.arange(4, CTX).float().expand(1, hkv, -1), range(4, CTX), range(4)
    raise AssertionError(name)


def assert_keeps_a_top_set(held: torch.Tensor, scores: torch.Tensor, candidates: range, always: range, k: int):
    """Each head of `held` (1, Hkv, k) keeps `always` and k - len(always) candidates, none scoring below a candidate
    it evicted: exactly the reference's top set, up to the order among equal scores (max pooling makes neighbours
    equal, and which of them a top-k takes is arbitrary)."""
    assert held.shape[-1] == k
    for h, head in enumerate(held[0].tolist()):
        assert set(always) <= set(head), f"head {h}"
        kept = [i for i, p in enumerate(candidates) if p in set(head)]
        evicted = [i for i, p in enumerate(candidates) if p not in set(head)]
        assert len(kept) == k - len(always), f"head {h}"
        s = scores[0, h]
        assert not evicted or s[kept].min() >= s[evicted].max(), f"head {h}: a better-scoring token was evicted"


WINDOW = 8  # tests.conftest.policy gives SnapKV and PyramidKV an 8-token observation window
# Tokens held per layer of the 3-layer tiny Llama at a budget of 24 tokens of CTX = 96, by hand:
# uniform policies hold 24 everywhere. PyramidKV by the reference formula (k = 24, window 8): beta 20 gives
# low = 24/20 = 1.2 < window 8, so the reference falls back to SnapKV's uniform 24; beta 2 gives low = 12,
# high = 2*24 - 12 = 36 (below 96 - 8 = 88, no cap), step (36 - 12)/2 = 12 -> 36, 24, 12 (same 72 in all).
CASES = [
    ("h2o", {}, [24] * 3),
    ("knorm", {}, [24] * 3),
    ("streaming_llm", {}, [24] * 3),
    *[("snapkv", {"pooling": p}, [24] * 3) for p in ("avg", "max")],
    *[("pyramidkv", {"pooling": p}, [24] * 3) for p in ("avg", "max")],
    *[("pyramidkv", {"pooling": p, "beta": 2}, [36, 24, 12]) for p in ("avg", "max")],
]


@pytest.mark.parametrize(
    ("name", "options", "held"),
    CASES,
    ids=["-".join([n, *(f"{k}{v}" for k, v in o.items())]) for n, o, _ in CASES],
)
def test_kept_indices_equal_the_naive_reference(tiny, ids, reference, name, options, held):
    pol = policy(name, BUDGET, **options)
    _, cache = compressed(tiny.model, ids, pol)
    attentions, keys = reference
    assert [layer.positions.shape[-1] for layer in cache.layers] == held
    for layer_idx, (attn, k) in enumerate(zip(attentions, keys, strict=True)):
        scores, candidates, always = reference_choice(name, pol, attn, k, held[layer_idx])
        assert_keeps_a_top_set(cache.layers[layer_idx].positions, scores, candidates, always, held[layer_idx])


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
    before = [layer.state[AttentionMass()].clone() for layer in observed.layers]
    question = ids[:, CTX:]
    greedy(tiny.model, observed, question, 1, set())  # one forward: the question chunk
    with torch.inference_mode():
        attn = eager(input_ids=question, cache=plain, use_cache=True, output_attentions=True).attentions
    for layer, old, a in zip(observed.layers, before, attn, strict=True):
        hkv = layer.keys.shape[1]
        grown = torch.cat([old, old.new_zeros(1, hkv, QUESTION)], dim=-1)
        torch.testing.assert_close(layer.state[AttentionMass()], grown + by_kv_head(a.sum(dim=2), hkv))


def test_h2o_prefill_mass_is_observed_under_sdpa_not_eager(tiny, ids):
    assert tiny.model.config._attn_implementation == "evalkit_sdpa"
    _, obs = prefill(tiny.model, ids[:, :CTX], [policy("h2o", BUDGET)])
    assert set(obs) == set(range(tiny.model.config.num_hidden_layers))
    assert all(o[AttentionMass()].shape == (1, 2, CTX) for o in obs.values())
    # every query's attention sums to one, and the mass sums over queries and over the 2 heads of each group
    total = sum(o[AttentionMass()].sum() for o in obs.values())
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
    # a needle prompt as measured: 874 tokens, window 32, a quarter kept -> fallback; half kept -> a pyramid
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
    view = LayerView(0, 1, 6, torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 4), positions, {AttentionMass(): mass})
    assert H2O(budget=2, recent=0.0).select(view, 2).tolist() == [[[0, 1]]]
    assert H2O(budget=2, recent=0.0, normalize=True).select(view, 2).tolist() == [[[0, 3]]]


def view(positions, seen, keys=None, state=None, observations=None):
    """One layer, one KV head, one query head, head_dim 1: a LayerView whose scores can be worked out by hand."""
    from evalkit.policies import LayerView

    pos = torch.tensor(positions).view(1, 1, -1)
    if keys is None:
        keys = [0.0] * pos.shape[-1]
    keys = torch.tensor(keys, dtype=torch.float).view(1, 1, -1, 1)
    return LayerView(0, 1, seen, keys, torch.zeros_like(keys), pos, state or {}, observations or {})


# SnapKV by hand. Ten tokens, a window of the last 2 (positions 8, 9), each window query q = 1 (already scaled) and
# each key ln(w): query 8 sees keys 0..8, query 9 keys 0..9, so a prefix key j (0..7, seen by both) scores
# w_j (1/Z8 + 1/Z9), in proportion to w_j. The window token 9 takes most of the attention (w = 20).
SNAP_W = [6, 3, 1, 3, 4, 1, 1, 3, 6, 20]


def snap_view():
    keys = [math.log(w) for w in SNAP_W]
    obs = {WindowQueries(2): Window(torch.ones(1, 1, 2, 1), torch.tensor([8, 9]))}
    return view(list(range(10)), 10, keys=keys, observations=obs)


def test_snapkv_pools_the_prefix_only_with_the_zero_padding_counted_kernel_5():
    """Avg pooling, kernel 5, over the prefix w_0..w_7 = 6 3 1 3 4 1 1 3 with zeros beyond both ends, divided by 5:
    sums 10 13 17 12 10 12 9 5 -> the top two are positions 2 (17) and 1 (13); kept with the window: 1 2 8 9.
    What each departure would keep instead: the padding not counted (means 3.33 3.25 3.4 ...) 0 2; pooling over
    the window too (position 7 sums 1+1+3+6+20 = 31) 2 7; kernel 7 (sums 13 17 18 19 ...) 2 3; no pooling 0 4."""
    from evalkit.policies.snapkv import SnapKV

    assert SnapKV(budget=4, window=2).select(snap_view(), 4).tolist() == [[[1, 2, 8, 9]]]
    conf = policy("snapkv", 4)
    conf.window = 2  # tests.conftest.policy sets 8
    assert (conf.kernel, conf.pooling) == (5, "avg")
    assert conf.select(snap_view(), 4).tolist() == [[[1, 2, 8, 9]]]


def test_snapkv_max_pooling_by_hand():
    """Max over the 5 prefix scores centred on each position (nothing beyond the prefix): 6 6 6 4 4 4 4 3 -> the top
    three are 0 1 2, kept with the window: 0 1 2 8 9. Pooling over the window too would give position 7 the 20."""
    from evalkit.policies.snapkv import SnapKV

    assert SnapKV(budget=5, window=2, pooling="max").select(snap_view(), 5).tolist() == [[[0, 1, 2, 8, 9]]]


def test_h2o_keeps_the_recent_share_then_the_heaviest_by_hand():
    """Eight tokens seen, masses by hand 5 1 4 2 3 0.5 0.1 0.2. Keeping 4 with recent=0.5: the 2 most recent (6, 7,
    however light) and the two heaviest of the rest, 0 (5) and 2 (4). Keeping 5: int(0.5 * 5) = 2 recent, as the
    H2O code rounds, and three heavy, 0 2 4; rounding up would keep 5 6 7 and 0 2."""
    from evalkit.policies.h2o import H2O

    state = {AttentionMass(): torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0, 0.5, 0.1, 0.2]).view(1, 1, 8)}
    v = view(list(range(8)), 8, state=state)
    assert H2O(budget=4).select(v, 4).tolist() == [[[0, 2, 6, 7]]]
    assert H2O(budget=5).select(v, 5).tolist() == [[[0, 2, 4, 6, 7]]]


def test_streaming_llm_keeps_the_sinks_and_the_most_recent_by_hand():
    """After earlier evictions a head holds positions 0 1 2 3 7 8 9 10 11 12 of 13 seen. Keeping 7 with 4 sinks:
    the sinks 0 1 2 3 and the three most recent, 10 11 12 (indices 5 6 7 8 9 -> 7 8 9 of the held list)."""
    from evalkit.policies.streaming_llm import StreamingLLM

    v = view([0, 1, 2, 3, 7, 8, 9, 10, 11, 12], 13)
    assert StreamingLLM(budget=7).select(v, 7).tolist() == [[[0, 1, 2, 3, 7, 8, 9]]]
    assert policy("streaming_llm", 7).select(v, 7).tolist() == [[[0, 1, 2, 3, 7, 8, 9]]]


def test_knorm_keeps_the_keys_of_lowest_norm_by_hand():
    """Keys (head_dim 1) 3 -1 2 -5 0.5: norms 3 1 2 5 0.5, the two lowest at indices 4 and 1."""
    from evalkit.policies.knorm import KNorm

    assert KNorm(budget=2).select(view(list(range(5)), 5, keys=[3.0, -1.0, 2.0, -5.0, 0.5]), 2).tolist() == [[[1, 4]]]
