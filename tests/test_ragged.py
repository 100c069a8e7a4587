"""Head-adaptive policies on ragged storage (AdaKV, DuoAttention) and compression every N decode steps.

Storage: each KV head of a layer holds its own count, padded to the longest head and masked out of the attention.
The masked-full-attention reference of test_cache_invariants covers both policies (every token a head dropped is
masked in a plain attention over the whole sequence); here: the choices by hand, the counts and bytes, padding that
cannot leak, head roles from the paper's pattern format and from evalkit's calibration, and decode_interval on a
teacher-forced continuation.
"""

from __future__ import annotations

import json

import pytest
import torch

from evalkit.attention.observation import Attended
from evalkit.attention.sdpa import observe
from evalkit.engine.engine import evictor, greedy, teacher_forced
from evalkit.errors import ConfigError
from evalkit.kv.cache import allocated_per_layer, deployed_bytes, held_per_layer, kv_bytes
from evalkit.kv.quantized import QuantSpec
from evalkit.kv.variant import Variant
from evalkit.policies import LayerView
from evalkit.policies.adakv import AdaKV
from evalkit.policies.duo_attention import NeedleAttention, read_pattern
from evalkit.policies.knorm import KNorm
from evalkit.records import SAMPLES, read_rows
from tests.conftest import CTX, DUO_PATTERN, QUESTION, compressed, policy, run_cli

# -- AdaKV ----------------------------------------------------------------------------------------------------------

# Two KV heads of six one-dimensional keys; KNorm scores -|k| (the smallest keys are kept).
# Head 0: |k| = 1 2 3 4 5 6; head 1: 10 20 7 30 40 50 (all larger than head 0's).
NORMS = [[1.0, 2, 3, 4, 5, 6], [10.0, 20, 7, 30, 40, 50]]


def norms_view() -> LayerView:
    k = torch.tensor(NORMS).view(1, 2, 6, 1)
    return LayerView(0, 1, 6, k, torch.ones_like(k), torch.arange(6).expand(1, 2, 6))


def test_adakv_shares_the_layer_budget_across_heads_with_the_floor_by_hand():
    """k = 3 per head, so the layer keeps 6. alpha 0.2: each head first keeps max(1, int(0.6)) = 1 best token (head 0:
    |k| = 1 at index 0; head 1: 7 at index 2); the other 4 go to the best scores of either head: -2 -3 -4 -5, all of
    head 0. Head 0 keeps indices 0-4, head 1 only index 2 (padding -1). Per-head top-3 (plain KNorm) would keep 0 1 2
    in both. Without the floor (alpha 0) the six best are all head 0's and head 1 keeps nothing."""
    ada = AdaKV(inner=KNorm(budget=3), budget=3, alpha=0.2)
    assert ada.select(norms_view(), 3).tolist() == [[[0, 1, 2, 3, 4], [2, -1, -1, -1, -1]]]
    no_floor = AdaKV(inner=KNorm(budget=3), budget=3, alpha=0.0).select(norms_view(), 3)
    assert no_floor.tolist() == [[[0, 1, 2, 3, 4, 5], [-1, -1, -1, -1, -1, -1]]]


def test_adakv_with_a_full_floor_is_the_inner_policy_per_head():
    """alpha 1: every head keeps its own k best before any sharing, which fills the layer's k x Hkv: the uniform
    per-head choice. By hand: head 0 keeps |k| 1 2 3 (indices 0 1 2), head 1 keeps 7 10 20 (indices 2 0 1)."""
    ada = AdaKV(inner=KNorm(budget=3), budget=3, alpha=1.0)
    assert ada.select(norms_view(), 3).tolist() == [[[0, 1, 2], [0, 1, 2]]]
    assert KNorm(budget=3).select(norms_view(), 3).tolist() == [[[0, 1, 2], [0, 1, 2]]]


def test_adakv_holds_the_layer_budget_in_ragged_heads_and_records_both_counts(tiny, ids):
    """adakv(snapkv) at 24 of 96 tokens: each layer holds 24 x 2 tokens over its 2 KV heads, split unevenly in at
    least one layer (otherwise the test proves nothing about ragged storage). Bytes: `kv_bytes` is what is allocated
    here (float32 keys and values of the longest head, for every head), `deployed_bytes` the real tokens in fp16."""
    pol = policy("adakv", 24)
    _, cache = compressed(tiny.model, ids, pol)
    counts = [layer.tokens()[0].tolist() for layer in cache.layers]
    assert all(sum(c) == 48 for c in counts), counts
    assert any(c[0] != c[1] for c in counts), counts
    assert held_per_layer(cache) == [24] * 3
    assert allocated_per_layer(cache) == [max(c) for c in counts]
    d = tiny.model.config.head_dim
    assert kv_bytes(cache) == sum(2 * 2 * max(c) * d * 4 for c in counts)  # K and V, 2 heads, float32
    assert deployed_bytes(cache) == 3 * 48 * 2 * d * 2  # K and V, fp16


def test_ragged_padding_cannot_leak_into_the_attention(tiny, ids):
    """Fill every padding slot with huge keys and values: the logits of the next tokens must not move. Without the
    per-head mask, a key of 1e4 would take all the attention."""
    pol = policy("adakv", 24)
    _, cache = compressed(tiny.model, ids, pol)
    _, clean = compressed(tiny.model, ids, pol)
    for layer in cache.layers:
        if layer.valid is not None:
            pad = ~layer.valid[..., None]
            layer.keys = layer.keys.masked_fill(pad, 1e4)
            layer.values = layer.values.masked_fill(pad, 1e4)
    assert any(layer.valid is not None for layer in cache.layers)
    got = greedy(tiny.model, cache, ids[:, CTX:], 3, set())
    want = greedy(tiny.model, clean, ids[:, CTX:], 3, set())
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_forward_that_does_not_name_a_ragged_cache_is_refused_before_it_reads_padding(tiny, ids):
    """A model forward over a ragged cache without observe(): plain SDPA would attend the padding slots, so the layer
    refuses it, before it has changed (the same forward, naming its cache, then runs)."""
    _, cache = compressed(tiny.model, ids, policy("adakv", 24))
    assert any(layer.valid is not None for layer in cache.layers)
    seen = [layer.seen for layer in cache.layers]
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"without observe\(recorder, cache\)"):
        tiny.model(input_ids=ids[:, CTX : CTX + 1], cache=cache, use_cache=True)
    ragged = next(i for i, layer in enumerate(cache.layers) if layer.valid is not None)
    assert cache.layers[ragged].seen == seen[ragged], "the refused update changed nothing"
    with torch.inference_mode():
        tiny.model(input_ids=ids[:, CTX : CTX + 1], cache=cache, use_cache=True, **observe(None, cache))


def test_adakv_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="compresses once"):
        AdaKV(inner=KNorm(budget=0.5), budget=0.5, decode=True).validate(None)
    with pytest.raises(ConfigError, match="alpha"):
        AdaKV(inner=KNorm(budget=0.5), budget=0.5, alpha=1.5).validate(None)
    with pytest.raises(ConfigError, match="quant=none"):
        Variant(policy("adakv", 0.5), quant=QuantSpec(name="int8", bits=8)).validate()


# -- DuoAttention ---------------------------------------------------------------------------------------------------


def test_duo_roles_from_the_pattern_file_by_hand():
    """tests/data/duo_tiny_pattern.tsv, 3 layers x 2 KV heads: 0.3 0.9 / 0.8 0.2 / 0.1 0.6. At budget 0.5,
    round(6 x 0.5) = 3 heads stream, the lowest: 0.1 (layer 2 head 0), 0.2 (1, 1), 0.3 (0, 0). At 1/3, four: also
    0.6 (2, 1). At 1.0 none."""
    assert read_pattern(str(DUO_PATTERN), (3, 2)).tolist() == [[0.3, 0.9], [0.8, 0.2], [0.1, 0.6]]
    for budget, want in [(0.5, [[1, 0], [0, 1], [1, 0]]), (1 / 3, [[1, 0], [0, 1], [1, 1]]), (1.0, [[0, 0]] * 3)]:
        pol = policy("duo_attention", budget)
        pol.assign(read_pattern(pol.pattern, (3, 2)))
        assert pol.streaming.int().tolist() == want, budget
    with pytest.raises(ConfigError, match="3 x 2 scores; the model has 4 layers"):
        read_pattern(str(DUO_PATTERN), (4, 2))


def test_duo_streaming_heads_keep_sinks_and_recent_after_the_prompt_and_every_step(tiny, ids):
    """Sink 4, recent 16. After the 96-token prompt a streaming head holds 0-3 and 80-95 (20 tokens), a retrieval
    head all 96; the layer's mean is (96 + 20) / 2 = 58, its allocation 96. After the question (seen 103): 0-3 and
    87-102 against 0-102, mean 61.5; then every step adds one token to the retrieval head only (+0.5)."""
    pol = policy("duo_attention", 0.5)
    _, cache = compressed(tiny.model, ids, pol)
    streaming = [[1, 0], [0, 1], [1, 0]]
    assert held_per_layer(cache) == [58.0] * 3 and allocated_per_layer(cache) == [96] * 3
    seen_means = []

    def check():
        after(*()) if after else None
        seen = cache.get_seq_length()
        seen_means.append(held_per_layer(cache)[0])
        for layer, roles in zip(cache.layers, streaming, strict=True):
            for head, stream in enumerate(roles):
                pos = layer.positions[0, head]
                pos = pos[pos >= 0].tolist()
                want = [*range(4), *range(seen - 16, seen)] if stream else list(range(seen))
                assert pos == want, (seen, head)

    after = evictor(cache, pol)
    greedy(tiny.model, cache, ids[:, CTX:], 3, set(), check)
    assert seen_means == [61.5, 62.0, 62.5]


def test_duo_budget_is_a_share_of_heads_not_tokens():
    with pytest.raises(ConfigError, match="fraction of KV heads"):
        policy("duo_attention", 0.5).__class__(budget=64).validate(None)


def test_needle_attention_scores_a_head_by_the_attention_on_the_needle_by_hand():
    """One KV head shared by two query heads, head_dim 1, three keys 0, ln 3, 0, the needle at index 1; the last
    query is 1 in head a, 0 in head b (scaling 1). Head a: softmax(0, ln 3, 0) = 1/5 3/5 1/5, 3/5 on the needle;
    head b: uniform, 1/3. The KV head's score sums its group: 3/5 + 1/3 = 14/15."""
    obs = NeedleAttention(evidence=[1], n_queries=1)
    query = torch.tensor([1.0, 0.0]).view(1, 2, 1, 1)
    key = torch.tensor([0.0, torch.log(torch.tensor(3.0)), 0.0]).view(1, 1, 3, 1)
    obs.record(0, object(), Attended(None, query, key, 1.0, 3))
    assert obs.mass[0].tolist() == pytest.approx([14 / 15])


def test_duo_calibrates_on_needles_and_records_roles_tokens_and_bytes(tmp_path):
    """Through the CLI beside adakv(snapkv): the calibration runs once (run.json `prepared`: 3 x 2 scores, 3 of 6 heads
    streaming at 0.5); the rows give the tokens really held (mean per head) below the slots allocated, and bytes."""
    result = run_cli(
        "model=tiny-random",
        "variants=[duo_attention@0.5,'adakv(snapkv)@0.5']",
        "task.context_lengths=[512]",
        "task.depths=[0.5]",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    duo = run["prepared"]["duo_attention@0.5"]
    assert duo["source"].startswith("calibration: 8 synthetic needles of 1024 tokens")
    assert len(duo["head_scores"]) == 3 and all(len(r) == 2 for r in duo["head_scores"])
    assert duo["retrieval_heads"] == 3 and sum(map(sum, duo["streaming"])) == 3
    rows = {r["variant"]: r for r in read_rows(tmp_path / SAMPLES)}
    n = rows["baseline"]["context_tokens"]
    r = rows["duo_attention@0.5"]
    # streaming heads: 64 sinks + 256 recent of n; retrieval heads: n. Layers with one of each: (n + 320) / 2.
    # allocated: the longest head, n unless both heads of the layer stream
    for held, allocated, stream in zip(
        r["tokens_held_per_layer"], r["tokens_allocated_per_layer"], duo["streaming"], strict=True
    ):
        assert (held, allocated) == {0: (n, n), 1: ((n + 320) / 2, n), 2: (320, 320)}[sum(stream)]
    assert r["kv_bytes_deployed"] < rows["baseline"]["kv_bytes_deployed"]
    ada = rows["adakv(snapkv)@0.5"]
    assert ada["tokens_held_per_layer"] == [pytest.approx(-(-n // 2))] * 3


# -- decode_interval --------------------------------------------------------------------------------------------------


def test_decode_interval_evicts_every_nth_forward_of_a_teacher_forced_continuation(tiny, ids):
    """window at 24 tokens, decode_interval 3, the 7 question tokens teacher-forced one at a time (6 forwards): held
    after forwards 1..6 is 25 26 24 25 26 24 (the budget plus the tokens since the last eviction), and at forward 3
    (seen 99) the 24 most recent, positions 75-98. Interval 1 holds 24 after every forward. The peak is measured
    before eviction: one token above the budget with interval 1, three (27) with interval 3."""
    held, pos = {}, {}
    peaks = {}
    for interval in (1, 3):
        pol = policy("window", 24, decode_interval=interval)
        _, cache = compressed(tiny.model, ids, pol)
        evict, trace = evictor(cache, pol), []

        def after(c=cache, e=evict, t=trace, i=interval):
            e()
            t.append(held_per_layer(c)[0])
            if len(t) == 3:
                pos[i] = c.layers[0].positions[0, 0].tolist()

        peaks[interval] = teacher_forced(tiny.model, cache, ids[:, CTX:], after).peak_bytes
        held[interval] = trace
    assert held == {1: [24] * 6, 3: [25, 26, 24, 25, 26, 24]}
    assert pos[3] == list(range(99 - 24, 99)) == pos[1]
    per_token = 3 * 2 * 2 * tiny.model.config.head_dim * 4  # layers x KV heads x (K, V) x head_dim x float32
    assert peaks == {1: 25 * per_token, 3: 27 * per_token}
    assert QUESTION - 1 == 6  # forwards of the teacher-forced question


@pytest.mark.parametrize("name", ["tova", "keydiff", "h2o", "streaming_llm"])
def test_decode_interval_holds_for_any_scorer_on_a_teacher_forced_continuation(tiny, ids, name):
    """The interval is the engine's, not the policy's: every scorer that evicts while decoding holds the budget plus
    the tokens since its last eviction, 25 26 24 25 26 24 at 24 tokens and interval 3 (as worked out for window)."""
    pol = policy(name, 24, decode=True, decode_interval=3)
    _, cache = compressed(tiny.model, ids, pol)
    evict, trace = evictor(cache, pol), []
    teacher_forced(tiny.model, cache, ids[:, CTX:], lambda: (evict(), trace.append(held_per_layer(cache)[0])))
    assert trace == [25, 26, 24, 25, 26, 24]


def test_decode_interval_must_be_positive():
    with pytest.raises(ConfigError, match="decode_interval=0"):
        policy("window", 24, decode_interval=0).validate(None)
