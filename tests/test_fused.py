"""H2O's attention mass and the attention output from one set of probabilities per query chunk
(evalkit.attention.fused): the output must be SDPA's, the mass the column sums of the materialised softmax, on small
inputs and on the model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from evalkit.attention import observation
from evalkit.attention.fused import CHUNK_ELEMENTS, attend_with_mass, query_chunk
from evalkit.attention.observation import AttentionMass, PrefillRecorder
from evalkit.attention.sdpa import causal_tail_mask, mask_padding, observe
from tests.conftest import CTX, by_kv_head

SCALE = 0.25


def materialised(q, k, v, visible):
    """The plain reference: the whole (Tq x Tk) softmax, each query head over its KV head's keys and values; the
    output as transformers' SDPA forward returns it (B, Tq, Hq, D) and the mass summed over queries and the group."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    probs = ((q @ keys.transpose(-1, -2)) * SCALE).masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ values).transpose(1, 2), by_kv_head(probs.sum(dim=2), k.shape[1])


def inputs(tq, tk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 4, tq, 16, generator=g),
        torch.randn(1, 2, tk, 16, generator=g) * 2,
        torch.randn(1, 2, tk, 16, generator=g),
    )


@pytest.mark.parametrize(("tq", "tk"), [(25, 25), (10, 25), (1, 25)], ids=["prefill", "past-and-chunk", "one-step"])
@pytest.mark.parametrize("chunk_elements", [1, 300, CHUNK_ELEMENTS], ids=["one-query", "three-queries", "one-chunk"])
def test_output_and_mass_equal_the_materialised_softmax(tq, tk, chunk_elements):
    """Causal queries that are the last tq keys (mask None), in chunks of 1 query, of 3 (300 scores over 4 heads x 25
    keys; 10 and 25 queries leave a shorter last chunk) and in one chunk: the output equals the materialised
    softmax's and torch's SDPA (bottom-right causal mask), the mass its column sums. Catches a chunk that sees keys
    after its queries, a masked diagonal block at the wrong offset, a mass summed over the wrong axis or without
    the group."""
    q, k, v = inputs(tq, tk)
    visible = causal_tail_mask(tq, tk, q.device)
    out, mass = attend_with_mass(q, k, v, SCALE, None, chunk_elements)
    want_out, want_mass = materialised(q, k, v, visible)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=1e-6)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(out, sdpa.transpose(1, 2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mass.sum(), torch.tensor(4.0 * tq))  # each query of each head gives out 1


def test_a_per_head_padding_mask_and_an_additive_mask_are_applied():
    """A ragged layer's mask (evalkit.attention.sdpa.mask_padding: causal and, per KV head, only its real slots) and an
    additive float mask (0 attended, -inf not) must give the materialised result; a padded slot gets no mass."""
    q, k, v = inputs(6, 20, seed=1)
    valid = torch.ones(1, 2, 20, dtype=torch.bool)
    valid[0, 0, [3, 7, 11]] = False
    valid[0, 1, [0, 19 - 6]] = False
    visible = mask_padding(None, valid, q)  # (1, Hq, 6, 20)
    for mask in (visible, torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))):
        out, mass = attend_with_mass(q, k, v, SCALE, mask, chunk_elements=300)
        want_out, want_mass = materialised(q, k, v, visible)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=1e-6)
        assert mass[0, 0, [3, 7, 11]].eq(0).all() and mass[0, 1, [0, 13]].eq(0).all()


def test_h2o_prefill_keeps_sdpa_logits_and_takes_the_mass_from_the_same_pass(tiny, eager, ids, monkeypatch):
    """On the tiny model, observing H2O's mass must leave the logits those of plain SDPA (within float tolerance),
    give eager attention's column sums, and not run the second QK^T pass (observation.attention_mass) at all."""

    def second_pass(*args, **kwargs):
        raise AssertionError("the mass was computed in a second pass")

    monkeypatch.setattr(observation, "attention_mass", second_pass)
    context = ids[:, :CTX]
    observer = PrefillRecorder((AttentionMass(),))
    plain = copy.deepcopy(tiny.model)
    plain.set_attn_implementation("sdpa")
    with torch.inference_mode():
        cache = DynamicCache(config=tiny.model.config)
        got = tiny.model(input_ids=context, cache=cache, use_cache=True, **observe(observer, cache)).logits
        want = plain(input_ids=context).logits
        attn = eager(input_ids=context, output_attentions=True).attentions
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    hkv = tiny.model.config.num_key_value_heads
    for layer, a in enumerate(attn):
        torch.testing.assert_close(observer.observations[layer][AttentionMass()], by_kv_head(a.sum(dim=2), hkv))


def test_scores_per_chunk_stay_within_the_budget():
    """The scratch buffers hold at most CHUNK_ELEMENTS scores each, whatever the context (memory bounded by the chunk,
    never by Tq x Tk): at 8k and 128k tokens with SmolLM2's 9 query heads."""
    for keys in (8192, 131072):
        assert query_chunk(1, 9, keys) * 9 * keys <= CHUNK_ELEMENTS
    assert query_chunk(1, 9, 1 << 22) == 1  # beyond the budget a chunk is one query, never zero


def test_a_workspace_is_reused_from_layer_to_layer_and_changes_nothing():
    """Two calls of one shape with one workspace (two layers of one forward): each result equals the materialised
    softmax's, the second writes into the first's output buffer and scores (the same storage: no new buffer per
    layer in the allocator's heap), and a longer call grows the score buffer. With autograd recording, nothing is
    reused: a tensor an earlier layer's graph saved is never written over."""
    workspace: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        results = []
        for seed in (0, 1):
            q, k, v = inputs(25, 25, seed)
            out, mass = attend_with_mass(q, k, v, SCALE, None, 300, workspace)
            want_out, want_mass = materialised(q, k, v, causal_tail_mask(25, 25, q.device))
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(mass, want_mass, rtol=1e-5, atol=1e-6)
            results.append((out.data_ptr(), workspace["scores"].data_ptr()))
        assert results[0] == results[1]
        # chunks of 6 queries x 2 heads x 25 keys = 300 scores; 12 x 2 x 40 = 960 need a larger buffer, 3 x 2 x 40 not
        attend_with_mass(*inputs(25, 40), SCALE, None, 300, workspace)
        assert workspace["scores"].data_ptr() == results[0][1]
        attend_with_mass(*inputs(25, 40), SCALE, None, 1000, workspace)
        assert workspace["scores"].numel() == 960 and workspace["scores"].data_ptr() != results[0][1]
    before = dict(workspace)
    out, _ = attend_with_mass(*inputs(25, 25), SCALE, None, 300, workspace)
    assert out.data_ptr() != before["out"].data_ptr() and workspace.keys() == before.keys()
