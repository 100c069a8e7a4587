"""window, keydiff and tova against references worked out by hand on small hand-built layers (the tokens kept
written out, with what a departure from the definition would keep instead), against plain references on the tiny
model (transformers' eager attention matrices, none of evalkit's helpers), through one decode step for tova and
window, and once end to end through the CLI in a `variants=[...]` sweep."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from evalkit.attention.observation import Attended, StepRecorder, Window, WindowQueries
from evalkit.engine.engine import greedy
from evalkit.kv.cache import EvictingLayer, enforce, held_per_layer
from evalkit.policies import LayerView
from evalkit.policies.keydiff import KeyDiff
from evalkit.policies.streaming_llm import StreamingLLM
from evalkit.policies.tova import TOVA
from evalkit.policies.window import SlidingWindow
from evalkit.records import SAMPLES, read_rows
from tests.conftest import CTX, QUESTION, compressed, policy, run_cli

BUDGET = 24


def layer_view(keys: list[list[list[float]]], seen: int, observations=None) -> LayerView:
    """One layer whose KV head h holds keys[h] (T rows of head_dim numbers) at positions seen - T .. seen - 1."""
    k = torch.tensor(keys, dtype=torch.float).unsqueeze(0)  # (1, Hkv, T, D)
    t = k.shape[2]
    pos = torch.arange(seen - t, seen).expand(1, k.shape[1], t)
    return LayerView(0, 1, seen, k, torch.zeros_like(k), pos, {}, observations or {})


# -- window ---------------------------------------------------------------------------------------------------


def test_window_keeps_the_most_recent_and_no_sinks_by_hand():
    """A head holds positions 0 1 2 3 7 8 9 10 11 12 of 13 seen (earlier evictions). Keeping 4: the four most recent,
    9 10 11 12 (held indices 6 7 8 9), whatever came first; StreamingLLM with its 4 sinks keeps 0 1 2 3 instead."""
    held = [0, 1, 2, 3, 7, 8, 9, 10, 11, 12]
    v = LayerView(0, 1, 13, torch.zeros(1, 1, 10, 2), torch.zeros(1, 1, 10, 2), torch.tensor(held).view(1, 1, -1))
    assert SlidingWindow(budget=4).select(v, 4).tolist() == [[[6, 7, 8, 9]]]
    assert policy("window", 4).select(v, 4).tolist() == [[[6, 7, 8, 9]]]
    assert StreamingLLM(budget=4, n_sink=4).select(v, 4).tolist() == [[[0, 1, 2, 3]]]
    assert SlidingWindow().min_tokens() == 1  # nothing protected: a budget of one token keeps the newest


def test_window_slides_through_the_prefill_and_every_decode_step(tiny, ids):
    """Budget 24 of CTX = 96: positions 72..95 after the prefill; the question (7 tokens, positions 96..102) in one
    forward, then 103, 104: after each forward the 24 most recent, in every layer and KV head."""
    pol = policy("window", BUDGET)
    _, cache = compressed(tiny.model, ids, pol)
    held = [[layer.positions.clone() for layer in cache.layers]]
    greedy(
        tiny.model,
        cache,
        ids[:, CTX:],
        3,
        set(),
        lambda: (enforce(cache, pol), held.append([layer.positions.clone() for layer in cache.layers])),
    )
    for newest, layers in zip([CTX - 1, CTX + QUESTION - 1, CTX + QUESTION, CTX + QUESTION + 1], held, strict=True):
        want = list(range(newest - BUDGET + 1, newest + 1))
        assert all(head.tolist() == want for positions in layers for head in positions[0]), newest


# -- keydiff --------------------------------------------------------------------------------------------------

# Head 0, six keys along the axes: x (1,0,0) (0.5,0,0) (1.5,0,0) at positions 0 3 5, y (0,2,0) at 1 and 4,
# z (0,0,10) at 2. Their unit vectors are the axes, so the anchor (the mean unit key) is (3, 2, 1) / 6, of norm
# sqrt(14) / 6, and cos(key, anchor) is 3/sqrt(14) = 0.802 for an x key, 2/sqrt(14) = 0.535 for y, 1/sqrt(14) =
# 0.267 for z: the rarer the direction, the less similar. Keeping 3: z and both y, positions 1 2 4.
# Head 1, keys z z y x z y at positions 0..5: anchor (1, 2, 3) / 6, cos x 0.267, y 0.535, z 0.802: x and both y,
# positions 2 3 5. Each head keeps its own tokens.
KEYDIFF_KEYS = [
    [[1, 0, 0], [0, 2, 0], [0, 0, 10], [0.5, 0, 0], [0, 2, 0], [1.5, 0, 0]],
    [[0, 0, 1], [0, 0, 3], [0, 1, 0], [2, 0, 0], [0, 0, 1], [0, 1, 0]],
]


def test_keydiff_keeps_the_keys_least_similar_to_the_mean_unit_key_by_hand():
    """What each departure would keep in head 0 instead: the raw keys' mean as anchor ((3, 4, 10) / 6, the large z
    key dominating: cos x 3/sqrt(125) = 0.268, y 0.358, z 0.894) keeps the x keys 0 3 5; the dot product with the
    anchor instead of the cosine (x 3 . 1/6 = 0.5, y 2 . 2/6 = 0.67, z 10 . 1/6 = 1.67) keeps the x keys too; and
    the lowest key norms (knorm) keep the x keys as well."""
    v = layer_view(KEYDIFF_KEYS, 6)
    assert KeyDiff(budget=3).select(v, 3).tolist() == [[[1, 2, 4], [2, 3, 5]]]
    assert policy("keydiff", 3).select(v, 3).tolist() == [[[1, 2, 4], [2, 3, 5]]]
    c1, c2, c3 = (n / math.sqrt(14) for n in (1, 2, 3))  # the cosines to the anchor: the score is minus them
    want = torch.tensor([[-c3, -c2, -c1, -c3, -c2, -c3], [-c3, -c3, -c2, -c1, -c3, -c2]])
    torch.testing.assert_close(KeyDiff().score(v)[0], want)


def test_keydiff_scores_by_direction_only():
    """Scaling any key, or all of a head's keys, changes neither the anchor's direction nor any cosine."""
    v = layer_view(KEYDIFF_KEYS, 6)
    scaled = layer_view(
        [[[c * s for c in key] for key, s in zip(head, [7, 0.1, 3, 2, 5, 0.5], strict=True)] for head in KEYDIFF_KEYS],
        6,
    )
    torch.testing.assert_close(KeyDiff().score(scaled), KeyDiff().score(v))


def test_keydiff_on_the_tiny_model_keeps_the_top_set_of_a_plain_reference(tiny, eager, ids):
    """The eager model's keys (B, Hkv, T, D), per head: cos(k_t, m) with m = mean_t k_t / |k_t|, written out as
    dot products over norms; the 24 lowest are kept (a top set, up to float rounding at the boundary)."""
    pol = policy("keydiff", BUDGET)
    _, cache = compressed(tiny.model, ids, pol)
    with torch.inference_mode():
        out = eager(input_ids=ids[:, :CTX], use_cache=True)
    for layer, ref in zip(cache.layers, out.past_key_values.layers, strict=True):
        k = ref.keys[0].double()  # (Hkv, T, D)
        m = (k / k.norm(dim=-1, keepdim=True)).mean(dim=1, keepdim=True)  # (Hkv, 1, D)
        cos = (k * m).sum(-1) / (k.norm(dim=-1) * m.norm(dim=-1))  # (Hkv, T)
        for h, head in enumerate(layer.positions[0].tolist()):
            assert_top_set(-cos[h], head, BUDGET)


def assert_top_set(scores: torch.Tensor, kept: list[int], k: int, tol: float = 1e-6):
    """`kept` holds k distinct positions, none scoring below an evicted one (up to tol)."""
    assert len(set(kept)) == len(kept) == k
    inside = torch.zeros_like(scores, dtype=torch.bool)
    inside[kept] = True
    assert scores[inside].min() >= scores[~inside].max() - tol, "a better-scoring token was evicted"


# -- tova -----------------------------------------------------------------------------------------------------

# One layer, 2 KV heads, 4 query heads (2 per KV head), head_dim 1; five tokens seen, the last query at position 4
# with q = 1 in every query head (already scaled) and keys ln(w): each query head's attention is w / sum(w).
# KV head 0: w = 4 1 1 1 3 (sum 10) -> 0.4 0.1 0.1 0.1 0.3 for its 2 query heads;
# KV head 1: w = 0.5 1 5 1.5 2 (sum 10) -> 0.05 0.1 0.5 0.15 0.2 for its 2.
# Mean over the 4 query heads: 0.225 0.1 0.3 0.125 0.25.
TOVA_W = [[4, 1, 1, 1, 3], [0.5, 1, 5, 1.5, 2]]


def tova_view(w, seen=5):
    keys = [[[math.log(x)] for x in head] for head in w]
    obs = {WindowQueries(1): Window(torch.ones(1, 4, 1, 1), torch.tensor([seen - 1]))}
    return layer_view(keys, seen, obs)


def test_tova_keeps_the_top_of_the_last_query_attention_averaged_over_all_heads_by_hand():
    """Keeping 2: positions 2 (0.3) and 4 (0.25) in both KV heads; each KV head on its own (SnapKV's way) would keep
    0 4 in head 0 and 2 4 in head 1. Keeping 3: 0 2 4 everywhere."""
    v = tova_view(TOVA_W)
    assert TOVA(budget=2).select(v, 2).tolist() == [[[2, 4], [2, 4]]]
    assert policy("tova", 3).select(v, 3).tolist() == [[[0, 2, 4], [0, 2, 4]]]
    torch.testing.assert_close(TOVA().score(v)[0, 0], torch.tensor([0.225, 0.1, 0.3, 0.125, 0.25]))


def test_tova_lets_the_newest_token_go_like_any_other_by_hand():
    """w = 4 1 1 3 1 and 0.5 1 5 2.5 1 (sums 10): mean attention 0.225 0.1 0.3 0.275 0.1. Keeping 2: 2 and 3; the
    newest token (4, 0.1) is dropped, as in TOVA's code (kvpress's TOVAPress would always keep it: 2 and 4)."""
    v = tova_view([[4, 1, 1, 3, 1], [0.5, 1, 5, 2.5, 1]])
    assert TOVA(budget=2).select(v, 2).tolist() == [[[2, 3], [2, 3]]]


def test_tova_decode_step_drops_the_token_the_newest_query_attends_to_least_by_hand():
    """A layer holds positions 0..3 (keys ln(w) of the first four tokens above) with the query of position 3 as its
    window; a decode step adds position 4 (key ln 3 in head 0, ln 2 in head 1) and its query (q = 1 in every head).
    Keeping 4: the new query's mean attention is 0.225 0.1 0.3 0.125 0.25 (as above), so position 1 goes: 0 2 3 4.
    Had the window kept the stale query of position 3, which cannot see position 4, the new token would score 0
    and go instead (0 1 2 3)."""
    w = [head[:4] for head in TOVA_W]
    keys = torch.tensor([[[math.log(x)] for x in head] for head in w]).unsqueeze(0)  # (1, 2, 4, 1)
    obs = {WindowQueries(1): Window(torch.ones(1, 4, 1, 1), torch.tensor([3]))}
    layer = EvictingLayer(keys, torch.zeros_like(keys), 4, observations=obs)
    cache = Cache(layers=[layer])
    new_key = torch.tensor([math.log(3), math.log(2)]).view(1, 2, 1, 1)
    keys_now, _ = layer.update(new_key, torch.zeros_like(new_key))  # the forward appends the new token ...
    at = Attended(None, torch.ones(1, 4, 1, 1), keys_now, 1.0, layer.seen)
    StepRecorder().record(0, layer, at)  # ... and its attention is observed
    assert layer.observations[WindowQueries(1)].positions.tolist() == [4]
    enforce(cache, TOVA(budget=4))
    assert layer.positions.tolist() == [[[0, 2, 3, 4], [0, 2, 3, 4]]]


def test_tova_on_the_tiny_model_follows_the_last_query_through_prefill_and_a_decode_step(tiny, eager, ids):
    """Reference from eager attention matrices: at the end of the prefill, the last context query's attention row,
    averaged over the 4 query heads, its top 24 kept in every KV head; then the question (7 tokens) in one forward
    over a plain cache of the 24 kept keys (absolute positions 96..102), whose last query's mean attention over the
    24 + 7 keys keeps 24 again."""
    pol = policy("tova", BUDGET)
    _, cache = compressed(tiny.model, ids, pol)
    with torch.inference_mode():
        out = eager(input_ids=ids[:, :CTX], output_attentions=True, use_cache=True)
    plain = DynamicCache(config=eager.config)
    for i, (layer, attn) in enumerate(zip(cache.layers, out.attentions, strict=True)):
        mean = attn[0, :, -1].double().mean(dim=0)  # (CTX,): the last query's row, mean over the query heads
        heads = layer.positions[0].tolist()
        assert all(head == heads[0] for head in heads), "every KV head keeps the same tokens"
        assert_top_set(mean, heads[0], BUDGET)
        plain.update(layer.keys.clone(), layer.values.clone(), i)
    before = [layer.positions[0, 0].clone() for layer in cache.layers]

    greedy(tiny.model, cache, ids[:, CTX:], 1, set(), lambda: enforce(cache, pol))  # one forward: the question
    with torch.inference_mode():
        step = eager(
            input_ids=ids[:, CTX:],
            position_ids=torch.arange(CTX, CTX + QUESTION)[None],
            cache=plain,
            use_cache=True,
            output_attentions=True,
        )
    assert held_per_layer(cache) == [BUDGET] * len(cache.layers)
    for layer, attn, old in zip(cache.layers, step.attentions, before, strict=True):
        held = torch.cat([old, torch.arange(CTX, CTX + QUESTION)])  # positions of the 24 + 7 keys
        mean = attn[0, :, -1].double().mean(dim=0)  # the last question query, mean over the query heads
        for head in layer.positions[0].tolist():
            idx = [held.tolist().index(p) for p in head]
            assert_top_set(mean, idx, BUDGET)


@pytest.mark.parametrize("budget", [0.25, 40])
def test_tova_keeps_one_set_per_layer_after_prefill_and_every_decode_step(tiny, ids, budget):
    pol = policy("tova", budget)
    _, cache = compressed(tiny.model, ids, pol)
    sets = []

    def check():
        for layer in cache.layers:
            sets.append(all(torch.equal(h, layer.positions[0, 0]) for h in layer.positions[0]))

    check()
    greedy(tiny.model, cache, ids[:, CTX:], 4, set(), lambda: (enforce(cache, pol), check()))
    assert len(sets) == 5 * len(cache.layers) and all(sets)


def test_tova_refuses_heads_that_hold_different_tokens():
    v = tova_view(TOVA_W)
    v.positions = torch.tensor([[[0, 1, 2, 3, 4], [0, 1, 2, 3, 5]]])
    with pytest.raises(ValueError, match="different tokens"):
        TOVA(budget=2).score(v)


def test_the_new_policies_declare_what_they_need():
    assert (TOVA().needs(), TOVA().observation_window()) == ((WindowQueries(1),), 1)
    for cls in (KeyDiff, SlidingWindow):
        assert (cls().needs(), cls().observation_window()) == ((), 0)
    for name in ("tova", "keydiff", "window"):
        pol = policy(name, 0.25)
        assert (pol.chunkable, pol.decodable, pol.decode) == (True, True, True)
        pol.validate(128)


# -- end to end -----------------------------------------------------------------------------------------------


def test_a_cli_sweep_runs_the_new_policies_on_one_prefill(tmp_path):
    variants = ["tova@0.5", "keydiff@0.5", "window@0.5"]
    result = run_cli(
        "model=tiny-random",
        f"variants=[{','.join(variants)}]",
        "task.context_lengths=[128]",
        "task.depths=[0.5]",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    rows = {r["variant"]: r for r in read_rows(tmp_path / SAMPLES)}
    assert set(rows) == {"baseline", *variants}
    for name in variants:
        r = rows[name]
        assert r["tokens_held_per_layer"] == [math.ceil(0.5 * r["context_tokens"])] * 3
        assert r["kv_bytes"] < rows["baseline"]["kv_bytes"]
        assert name in result.stdout
