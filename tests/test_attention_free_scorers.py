"""LagKV, CurDKV (cur) and Compactor's non-causal chunked attention (non_causal_attn) against references worked out
by hand on small hand-built layers, what a departure from the definition would keep instead, and a plain loop
reference for the chunked attention; the identity test and the cache invariants cover them with every policy in
conf/policy (tests/test_cache_invariants.py), kvpress's choices on the real model in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.attention.observation import Attended
from evalkit.errors import ConfigError
from evalkit.policies import LayerView
from evalkit.policies.cur import CUR
from evalkit.policies.lagkv import LagKV
from evalkit.policies.non_causal import ChunkAttention, NonCausalAttention, chunk_column_sums
from tests.conftest import policy, run_cli


def layer(keys: list, values: list, observations=None) -> LayerView:
    """One layer, one KV head holding `keys` and `values` (T rows of D numbers) at positions 0 .. T-1."""
    k, v = torch.tensor([[keys]], dtype=torch.float), torch.tensor([[values]], dtype=torch.float)
    t = k.shape[2]
    return LayerView(0, 1, t, k, v, torch.arange(t).expand(1, 1, t), {}, observations or {})


# -- lagkv ----------------------------------------------------------------------------------------------------

# One sink, partitions of 2: tokens 1-2 are scored against the range of tokens 3-4 (their lag reference); 3, 4 and 5
# (the last partition and the token after it) have no reference and are kept with the sink.
# Keys: reference 3 = (0, 0), 4 = (2, 4): range (2, 4). Token 1 (2, 0) normalises to (1, 0), channel std 1/sqrt(2);
# token 2 (1, 2) to (0.5, 0.5), std 0. Softmax over the partition: 0.670, 0.330.
# Values: reference (0, 0), (4, 2): range (4, 2). Token 1 (0, 0) -> std 0; token 2 (2, 0) -> (0.5, 0) -> std
# 0.5/sqrt(2). Softmax: 0.412, 0.588. The mean: token 1 0.541, token 2 0.459: token 1 ranks first in its partition.
LAG_KEYS = [[9, 9], [2, 0], [1, 2], [0, 0], [2, 4], [5, 5]]
LAG_VALUES = [[9, 9], [0, 0], [2, 0], [0, 0], [4, 2], [5, 5]]


def test_lagkv_keeps_sink_tail_and_the_best_of_each_partition_by_the_next_ones_range_by_hand():
    """Keeping 5 of 6 evicts token 2; the values alone would evict token 1 (the departure of scoring one of them)."""
    pol = LagKV(budget=5, n_sink=1, lag_size=2)
    v = layer(LAG_KEYS, LAG_VALUES)
    assert pol.select(v, 5).tolist() == [[[0, 1, 3, 4, 5]]]
    s1, s2 = math.sqrt(0.5), 0.5 * math.sqrt(0.5)
    key_soft = [1 / (1 + math.exp(-s1)), 1 / (1 + math.exp(s1))]
    value_soft = [1 / (1 + math.exp(s2)), 1 / (1 + math.exp(-s2))]
    mean = [(a + b) / 2 for a, b in zip(key_soft, value_soft, strict=True)]
    assert mean[0] > mean[1] and value_soft[1] > value_soft[0]  # the hand figures: keys decide against values
    assert pol.score(v)[0, 0].tolist() == [1.0, 0.5, 0.0, 1.0, 1.0, 1.0]  # ranks within the partition / 2
    values_only = layer(LAG_VALUES, LAG_VALUES)  # the value score twice
    assert pol.select(values_only, 5).tolist() == [[[0, 2, 3, 4, 5]]]


def test_lagkv_on_a_context_without_a_reference_keeps_the_sinks_then_the_newest():
    """Fewer than n_sink + 2 lag_size tokens: no partition has one after it; as kvpress, a sliding window."""
    pol = LagKV(budget=4, n_sink=2, lag_size=4)
    v = layer([[float(i), 1.0] for i in range(9)], [[1.0, float(i)] for i in range(9)])
    assert pol.select(v, 4).tolist() == [[[0, 1, 7, 8]]]
    assert LagKV(budget=2, n_sink=4, lag_size=4).select(layer([[1.0]] * 3, [[1.0]] * 3), 2).shape == (1, 1, 2)


# -- cur ------------------------------------------------------------------------------------------------------

# One sink, windows of 2 from token 0: (0, 1), (2, 3), (4). Squared key norms 1 4 | 1 3 | 5 -> shares 0.2 0.8 |
# 0.25 0.75 | 1; squared value norms 4 1 | 9 1 | 2 -> 0.8 0.2 | 0.9 0.1 | 1. Product: 0.16 0.16 | 0.225 0.075 | 1.
# Keeping 3: the sink (0), token 4 (1.0) and token 2 (0.225).
CUR_KEYS = [[1, 0], [0, 2], [1, 0], [1, math.sqrt(2)], [1, 2]]
CUR_VALUES = [[2, 0], [1, 0], [3, 0], [1, 0], [1, 1]]


def test_cur_keeps_sinks_then_the_largest_local_share_of_key_times_value_by_hand():
    """The departures: keys alone (shares 0.2 0.8 0.25 0.75 1) keep token 1 instead of 2; without the windows the
    mean of the raw squared norms is (1+4)/2 (4+1)/2 (1+9)/2 (3+1)/2 (5+2)/2."""
    v = layer(CUR_KEYS, CUR_VALUES)
    pol = CUR(budget=3, n_sink=1, window=2)
    assert pol.select(v, 3).tolist() == [[[0, 2, 4]]]
    torch.testing.assert_close(pol.score(v)[0, 0], torch.tensor([0.16, 0.16, 0.225, 0.075, 1.0]))
    assert CUR(budget=3, n_sink=1, window=2, combine="key").select(v, 3).tolist() == [[[0, 1, 4]]]
    torch.testing.assert_close(
        CUR(budget=3, n_sink=1, window=0, combine="mean").score(v)[0, 0], torch.tensor([2.5, 2.5, 5.0, 2.0, 3.5])
    )


def test_cur_refuses_what_it_does_not_define():
    for bad, match in ((CUR(combine="sum"), "combine='sum'"), (CUR(window=-1), "window=-1")):
        with pytest.raises(ConfigError, match=match):
            bad.validate(64)
    with pytest.raises(ConfigError, match="lag_size=1"):
        LagKV(lag_size=1).validate(64)
    with pytest.raises(ConfigError, match="chunk=0"):
        NonCausalAttention(chunk=0).validate(64)


# -- non_causal_attn ------------------------------------------------------------------------------------------


def loop_reference(q: list[list[float]], k: list[list[float]], chunk: int) -> list[float]:
    """One head, written out: chunks of `chunk` tokens; in each, every query's softmax over the chunk's keys (no
    mask, no scaling) added to each key; the last chunk padded to `chunk` with keys of logit 0 and queries that
    spread 1 evenly over the `chunk` slots."""
    s = len(q)
    out = [0.0] * s
    for lo in range(0, s, chunk):
        keys = list(range(lo, min(lo + chunk, s)))
        pad = chunk - len(keys)
        for i in keys:
            logits = [sum(a * b for a, b in zip(q[i], k[j], strict=True)) for j in keys] + [0.0] * pad
            top = max(logits)
            total = sum(math.exp(x - top) for x in logits)
            for n, j in enumerate(keys):
                out[j] += math.exp(logits[n] - top) / total
        for j in keys:
            out[j] += pad / chunk
    return out


def test_chunked_non_causal_attention_equals_a_plain_loop_with_kvpress_padding():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 11, 3), torch.randn(1, 2, 11, 3)  # 2 query heads per KV head; chunks 4 4 3(+1)
    got = chunk_column_sums(q, k, 4)
    for h in range(4):
        want = loop_reference(q[0, h].tolist(), k[0, h // 2].tolist(), 4)
        torch.testing.assert_close(got[0, h], torch.tensor(want), rtol=1e-5, atol=1e-6)
    # the observation: each KV head's mean over its 2 query heads
    at = Attended(None, q, k, scaling=1.0, seen=11)
    torch.testing.assert_close(ChunkAttention(4).prefill(at)[0], got[0].view(2, 2, 11).mean(dim=1))


def test_non_causal_attn_scores_received_attention_times_value_norm_pooled_over_3_by_hand():
    """Received 1 3 1 4 (given), value norms 1 2 1 1: products 1 6 1 4; pooled over 3 with the zero padding counted:
    7/3 8/3 11/3 5/3, so keeping 2 takes tokens 1 and 2. Unpooled (1 and 3) or by received attention alone (3 and 1)
    it would keep others."""
    received = torch.tensor([[[1.0, 3.0, 1.0, 4.0]]])
    v = layer([[1.0]] * 4, [[1.0], [-2.0], [1.0], [1.0]], {ChunkAttention(256): received})
    pol = NonCausalAttention(budget=2)
    torch.testing.assert_close(pol.score(v)[0, 0], torch.tensor([7 / 3, 8 / 3, 11 / 3, 5 / 3]))
    assert pol.select(v, 2).tolist() == [[[1, 2]]]


def test_the_scorers_are_prefill_methods_and_validate_from_their_yaml():
    for name in ("lagkv", "cur", "non_causal_attn"):
        pol = policy(name, 0.25)
        assert (pol.chunkable, pol.decodable, pol.decode) == (False, False, False)
        pol.validate(1024)
    assert NonCausalAttention().needs() == (ChunkAttention(256),)
    assert LagKV().needs() == CUR().needs() == ()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy=lagkv", "policy.decode=true"], "lagkv compresses once, after the prompt: set policy.decode=false"),
        (["policy=non_causal_attn", "prefill=chunked"], "non_causal_attn does not support a chunked prefill"),
        (["policy=cur", "policy.combine=sum"], "policy.combine='sum' is not one of product, mean, key, value"),
    ],
)
def test_what_they_cannot_run_is_refused_in_one_line(tmp_path, args, message):
    result = run_cli("model=tiny-random", *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
