"""CaM (kvpress's CAMPress): its merge against a plain loop, its choice and merges on the tiny model while decoding, its
repeatable draws, its refusals, end to end. The identity test and the cache invariants cover it with every policy in
conf/policy (tests/test_cache_invariants.py); kvpress's choices and merged values on the real model in
tests/test_peer_kvpress.py."""

from __future__ import annotations

import pytest
import torch

from evalkit.attention.observation import Attended
from evalkit.engine.decode import greedy
from evalkit.errors import ConfigError
from evalkit.kv.cache import enforce, full_attention_layers
from evalkit.policies.adakv import AdaKV
from evalkit.policies.cam import CaM, DecodeAttention, merged_into_windows
from evalkit.policies.knorm import KNorm
from evalkit.policies.snapkv import SnapKV
from tests.conftest import CTX, compressed, tiny_row


def merged_by_hand(values, attention, kept, window, draws):
    """A plain loop over heads and evicted tokens: CAMPress's rule written out, the Bernoulli draws given (`draws`,
    one per head and evicted token in position order) against the chances it computes here."""
    b, h, t, d = values.shape
    keep = kept[0, 0].tolist()
    gone = [j for j in range(t) if j not in keep]
    out = values[:, :, keep].clone().float()
    chances = torch.zeros(b, h, len(gone))
    for hi in range(h):
        for n, e in enumerate(gone):
            after = [i for i, j in enumerate(keep) if j > e][:window]
            if not after:
                continue
            mean = sum(float(attention[0, hi, keep[i]]) for i in after) / len(after)
            a = float(attention[0, hi, e])
            chances[0, hi, n] = 0.0 if a == mean == 0 else (1.0 if mean == 0 else min(max(a / mean, 0.0), 1.0))
    mask = draws(chances)
    for hi in range(h):
        for n, e in enumerate(gone):
            after = [i for i, j in enumerate(keep) if j > e][:window]
            for i in after:
                out[0, hi, i] += mask[0, hi, n] * values[0, hi, e].float() / len(after)
    return out


@pytest.mark.parametrize("window", [1, 3, 32])
def test_each_evicted_value_goes_by_chance_into_the_kept_tokens_after_it(window):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1, 2, 12, 4, generator=g)
    attention = torch.rand(1, 2, 12, generator=g)
    attention[0, 0, 5] = 0.0  # never merged in head 0; the last evicted token (11) has no kept token after it
    kept = torch.tensor([0, 2, 3, 6, 7, 9])[None, None].expand(1, 2, -1)
    got = merged_into_windows(values, attention, kept, window, generator=torch.Generator().manual_seed(7))
    want = merged_by_hand(
        values, attention, kept, window, lambda p: torch.bernoulli(p, generator=torch.Generator().manual_seed(7))
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, values[:, :, [0, 2, 3, 6, 7, 9]])  # control: something was merged
    sure = merged_into_windows(values, torch.ones(1, 2, 12), kept, window)  # every chance 1: every merge happens
    torch.testing.assert_close(sure, merged_by_hand(values, torch.ones(1, 2, 12), kept, window, torch.ceil))


def test_it_keeps_one_set_for_every_head_and_merges_only_once_decoding_has_attended(tiny, ids):
    """After the prompt (a quarter of 96: 24) every head keeps the 24 tokens whose key norm, averaged over the heads,
    is lowest (KNorm's choice), values as they were (no decoding attention yet); decoding then merges evicted values
    into kept ones (values no longer the full cache's) and keys stay as they were."""
    pol = CaM(inner=KNorm(), budget=24, decode_interval=1)
    full, cache = compressed(tiny.model, ids, pol)
    for i in full_attention_layers(cache):
        score = -full.layers[i].keys[0].float().norm(dim=-1).mean(dim=0)  # (T,) over the heads
        want = score.topk(24).indices.sort().values
        layer = cache.layers[i]
        assert all(torch.equal(layer.positions[0, h], want) for h in range(layer.positions.shape[1]))
        torch.testing.assert_close(layer.values, full.layers[i].values[:, :, want], rtol=0, atol=0)
    greedy(tiny.model, cache, ids[:, CTX:], 4, set(), lambda: enforce(cache, pol))
    merged = 0
    for i in full_attention_layers(cache):
        layer = cache.layers[i]
        prompt = layer.positions[0, 0] < CTX
        pos = layer.positions[0, 0][prompt]
        torch.testing.assert_close(layer.keys[:, :, prompt], full.layers[i].keys[:, :, pos], rtol=0, atol=0)
        merged += int((layer.values[:, :, prompt] != full.layers[i].values[:, :, pos]).any())
    assert merged > 0


def test_its_draws_repeat_with_its_seed_and_change_with_another(tiny, ids):
    """On the model, a seed's run twice holds the same values; the draws themselves follow the generator: the same
    chances (strictly between 0 and 1) under two seeds merge differently."""

    def values(seed):
        pol = CaM(inner=KNorm(), budget=24, decode_interval=1, seed=seed)
        _, cache = compressed(tiny.model, ids, pol)
        greedy(tiny.model, cache, ids[:, CTX:], 4, set(), lambda: enforce(cache, pol))
        return torch.cat([cache.layers[i].values.flatten() for i in full_attention_layers(cache)])

    assert torch.equal(values(0), values(0))
    g = torch.Generator().manual_seed(0)
    v, attention = torch.randn(1, 2, 40, 4, generator=g), torch.rand(1, 2, 40, generator=g)
    kept = torch.arange(0, 40, 2)[None, None].expand(1, 2, -1)
    one, other = (
        merged_into_windows(v, attention, kept, 4, generator=torch.Generator().manual_seed(s)) for s in (0, 1)
    )
    assert not torch.equal(one, other)


def test_a_forward_of_several_tokens_adds_its_last_tokens_attention_alone():
    """kvpress's CAMPress reads a forward by its last query's softmax over every key: a 3-token forward adds that,
    averaged over the 2 query heads of each KV head (written out with torch.softmax); a 1-token forward adds its own.
    Control: the sum over the forward's 3 queries (the fused mass) is another figure."""
    torch.manual_seed(0)
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8)
    at = Attended(model=None, query=query, key=key, scaling=8**-0.5, seen=10)
    held = torch.rand(1, 2, 10)
    logits = torch.einsum("bhd,bhtd->bht", query[:, :, -1], key.repeat_interleave(2, dim=1)) * 8**-0.5
    want = held + torch.softmax(logits, dim=-1).view(1, 2, 2, 10).mean(dim=2)
    torch.testing.assert_close(DecodeAttention().step(held, at), want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(held + at.mass / 2, want, atol=1e-3)
    one = Attended(model=None, query=query[:, :, -1:], key=key, scaling=8**-0.5, seen=10)
    torch.testing.assert_close(DecodeAttention().step(held, one), want, rtol=1e-5, atol=1e-6)


def test_what_it_cannot_do_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="^merge_budget=0"):
        CaM(inner=KNorm(), merge_budget=0).validate(None)
    with pytest.raises(ConfigError, match=r"adakv\(snapkv\) keeps ragged heads and cannot be wrapped"):
        CaM(inner=AdaKV(inner=SnapKV()), decode=False).validate(None)


def test_the_command_line_runs_it_while_decoding(tmp_path):
    row = tiny_row(tmp_path / "ok", "policy=cam", "policy.budget=0.5")
    assert row["variant"] == "cam(knorm)@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
