"""The policies that rewrite what they keep (KVPolicy.rewrite): key_rerotation (kept keys re-rotated to slots 0..k-1),
merging (evicted values folded into the most similar kept one), think (key channels pruned per head): each by hand or
against a plain reference, on the tiny model through transformers' own rotary code, its bytes, its refusals, and the
contract the engine holds a rewrite to. The identity test and the cache invariants cover them with every policy in
conf/policy (tests/test_cache_invariants.py); kvpress's tensors on the real model, tests/test_peer_kvpress.py."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from evalkit.attention.sdpa import observe
from evalkit.errors import ConfigError, PolicyError
from evalkit.kv.cache import deployed_bytes, fp16_bytes, full_attention_layers
from evalkit.policies import LayerView
from evalkit.policies.finch import Finch
from evalkit.policies.key_rerotation import KeyRerotation, rerotated
from evalkit.policies.merging import Merging, merged_values
from evalkit.policies.none import FullCache
from evalkit.policies.snapkv import SnapKV
from evalkit.policies.think import ThinK, pruned_channels
from tests.conftest import CTX, compressed, run_cli, sliding_model, tiny_row
from tests.test_criticalkv import FirstChannel


def rope(x: Tensor, positions: Tensor, rotary) -> Tensor:
    """x (1, H, T, D) rotated to `positions` (T,) by the model's own rotary embedding and apply_rotary_pos_emb."""
    cos, sin = rotary(x, positions[None])
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def test_rerotation_equals_rotating_the_raw_keys_to_their_new_slots(tiny):
    """Raw keys rotated to positions 3, 7, 20 by transformers' RoPE, then re-rotated: they equal the same raw keys
    rotated to 0, 1, 2 (rotations compose: R(j - p) R(p) = R(j)); keys at 0, 1, 2 already are left alone."""
    rotary = tiny.model.model.rotary_emb
    raw = torch.randn(1, 2, 3, tiny.model.config.head_dim, generator=torch.Generator().manual_seed(0))
    at = torch.tensor([3, 7, 20])
    got = rerotated(rope(raw, at, rotary), at.expand(1, 2, 3), rotary.inv_freq)
    torch.testing.assert_close(got, rope(raw, torch.arange(3), rotary), rtol=1e-5, atol=1e-5)
    slots = rope(raw, torch.arange(3), rotary)
    torch.testing.assert_close(rerotated(slots, torch.arange(3).expand(1, 2, 3), rotary.inv_freq), slots)


def test_key_rerotation_keeps_snapkvs_tokens_and_values_with_its_keys_at_their_slots(tiny, ids):
    """On the tiny model: the same positions and values as SnapKV alone; each kept key, rotated back from its position
    and forward to its slot by transformers' RoPE, is what the cache holds."""
    rotary = tiny.model.model.rotary_emb
    snap = compressed(tiny.model, ids, SnapKV(budget=0.25, window=8))[1]
    moved = compressed(tiny.model, ids, KeyRerotation(inner=SnapKV(window=8), budget=0.25))[1]
    for i in full_attention_layers(moved):
        a, b = snap.layers[i], moved.layers[i]
        assert torch.equal(a.positions, b.positions) and torch.equal(a.values, b.values)
        for h in range(a.keys.shape[1]):
            pos = a.positions[0, h]
            raw = rope(a.keys[:, h : h + 1], -pos, rotary)  # back to unrotated: rotation by -p
            want = rope(raw, torch.arange(len(pos)), rotary)
            torch.testing.assert_close(b.keys[:, h : h + 1], want, rtol=1e-4, atol=1e-4)


def merged_by_hand(keys, values, kept, threshold, fraction):
    """A plain loop over heads and evicted tokens: MergingPress's rule written out."""
    b, h, t, d = keys.shape
    out = torch.zeros(b, h, kept.shape[-1], d)
    for bi in range(b):
        for hi in range(h):
            keep = kept[bi, hi].tolist()
            gone = [j for j in range(t) if j not in keep]
            unit = keys[bi, hi] / keys[bi, hi].norm(dim=-1, keepdim=True).clamp(min=1e-6)
            best = [max(range(len(keep)), key=lambda i, e=e: float(unit[e] @ unit[keep[i]])) for e in gone]
            sims = [float(unit[e] @ unit[keep[i]]) for e, i in zip(gone, best, strict=True)]
            ok = [s >= threshold for s in sims]
            if fraction < 1.0 and any(ok):
                cut = torch.tensor([s if o else float("-inf") for s, o in zip(sims, ok, strict=True)])
                ok = [o and s >= float(cut.quantile(1 - fraction)) for s, o in zip(sims, ok, strict=True)]
            for n, j in enumerate(keep):
                v, total, added = values[bi, hi, j], 0.0, torch.zeros(d)
                for e, i, s, o in zip(gone, best, sims, ok, strict=True):
                    if i == n and o:
                        ne, nt = float(values[bi, hi, e].norm()), float(v.norm())
                        w = max(s, 0.0) * ne / (ne + nt + 1e-6)
                        total, added = total + w, added + w * values[bi, hi, e]
                out[bi, hi, n] = (v + added) / (1 + total) if total > 0 else v
    return out


def test_merging_folds_each_evicted_value_into_its_most_similar_kept_token_by_hand():
    """One head, keys (1,0) (0,1) (1,1) (-1,0), keeping tokens 0 and 1. Token 2 (cosine 0.707 to both; the first
    kept wins the tie) joins token 0 with weight 0.707 x |v2| / (|v2| + |v0|) = 0.707 x 2/3; token 3 (cosine -1
    and 0) joins token 1 with weight max(0, 0) = 0: nothing. Token 0's value (1, 0) becomes
    ((1, 0) + w (0, 2)) / (1 + w)."""
    keys = torch.tensor([[1.0, 0], [0, 1], [1, 1], [-1, 0]]).view(1, 1, 4, 2)
    values = torch.tensor([[1.0, 0], [0, 1], [0, 2], [5, 5]]).view(1, 1, 4, 2)
    w = 2**-0.5 * 2 / (2 + 1 + 1e-6)
    want = torch.tensor([[1 / (1 + w), 2 * w / (1 + w)], [0, 1]]).view(1, 1, 2, 2)
    got = merged_values(keys, values, torch.tensor([[[0, 1]]]), 0.0, 1.0)
    torch.testing.assert_close(got, want)
    # a threshold above 0.707 merges nothing
    torch.testing.assert_close(merged_values(keys, values, torch.tensor([[[0, 1]]]), 0.8, 1.0), values[:, :, :2])


@pytest.mark.parametrize(("threshold", "fraction"), [(0.0, 1.0), (0.1, 1.0), (0.0, 0.5)])
def test_merged_values_equal_a_plain_loop(threshold, fraction):
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 2, 12, 4, generator=g), torch.randn(1, 2, 12, 4, generator=g)
    kept = torch.stack([torch.randperm(12, generator=g)[:5].sort().values for _ in range(2)])[None]
    want = merged_by_hand(keys, values, kept, threshold, fraction)
    torch.testing.assert_close(merged_values(keys, values, kept, threshold, fraction), want, rtol=1e-5, atol=1e-6)


def test_merging_keeps_the_inner_tokens_and_keys_and_changes_only_values_on_the_model(tiny, ids):
    snap = compressed(tiny.model, ids, SnapKV(budget=0.25, window=8))[1]
    full, merged = compressed(tiny.model, ids, Merging(inner=SnapKV(window=8), budget=0.25))
    changed = 0
    for i in full_attention_layers(merged):
        a, b = snap.layers[i], merged.layers[i]
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)
        idx = a.positions  # the prefill holds every token at its position
        want = merged_by_hand(full.layers[i].keys, full.layers[i].values, idx, 0.0, 1.0)
        torch.testing.assert_close(b.values, want, rtol=1e-4, atol=1e-5)
        changed += int((b.values != a.values).any(-1).sum())
    assert changed > 0  # some kept value received a merge


def test_think_prunes_the_least_queried_channels_by_hand():
    """One KV head of two query heads, D = 4. Queries' mean squares per channel: head 0 (1, 4, 0, 1), head 1
    (1, 0, 2, 1): averaged (1, 2, 1, 1); keys' mean squares (4, 1, 1, 0.25): scores 4, 2, 1, 0.25. Pruning two zeroes
    channels 3 and 2."""
    q = torch.tensor([[[1.0, 2, 0, 1]], [[1.0, 0, 2**0.5, 1]]]).view(1, 2, 1, 4)
    keys = torch.tensor([[2.0, 1, 1, 0.5], [-2, -1, 1, 0.5]]).view(1, 1, 2, 4)
    assert sorted(pruned_channels(keys, q, 2)[0, 0].tolist()) == [2, 3]
    assert sorted(pruned_channels(keys, q, 1)[0, 0].tolist()) == [3]


def test_think_zeroes_half_the_key_channels_and_the_bytes_count_the_rest(tiny, ids):
    """ThinK alone keeps every token, zeroes int(D x 0.5) key channels per head of every full-attention layer, leaves
    the values; the deployed bytes count D/2 + D channels per token and head where the full cache counts 2D: 3/4."""
    full, thin = compressed(tiny.model, ids, ThinK(inner=FullCache(), channels=0.5, window=8))
    d = tiny.model.config.head_dim
    for i in full_attention_layers(thin):
        zero = ~(thin.layers[i].keys != 0).any(dim=2)  # (B, Hkv, D)
        assert (zero.sum(-1) == d // 2).all() and torch.equal(thin.layers[i].values, full.layers[i].values)
        kept = ~zero[..., None, :].expand_as(thin.layers[i].keys)
        assert torch.equal(thin.layers[i].keys[kept], full.layers[i].keys[kept])
    assert fp16_bytes(thin) == deployed_bytes(thin) == 3 * fp16_bytes(full) // 4


def test_think_after_snapkv_prunes_half_the_channels_of_snapkvs_tokens(tiny, ids):
    snap = compressed(tiny.model, ids, SnapKV(budget=0.25, window=8))[1]
    both = compressed(tiny.model, ids, ThinK(inner=SnapKV(window=8), budget=0.25, channels=0.5, window=8))[1]
    d = tiny.model.config.head_dim
    for i in full_attention_layers(both):
        a, b = snap.layers[i], both.layers[i]
        assert torch.equal(a.positions, b.positions) and torch.equal(a.values, b.values)
        zero = ~(b.keys != 0).any(dim=2)  # (B, Hkv, D): the channels pruned; the others hold SnapKV's keys
        assert (zero.sum(-1) == d // 2).all()
        left = ~zero[..., None, :].expand_as(b.keys)
        assert torch.equal(b.keys[left], a.keys[left])
    assert deployed_bytes(both) == 3 * deployed_bytes(snap) // 4


@dataclass(kw_only=True)
class Widening(FirstChannel):
    """A user's policy whose rewrite returns keys one token longer than it keeps (holding more than it is counted)."""

    name: str = "widening"

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor]:
        k = kept.shape[-1] + 1
        return view.keys[:, :, :k], view.values[:, :, :k]


@dataclass(kw_only=True)
class Poisoning(FirstChannel):
    """A user's policy whose rewrite holds NaN values."""

    name: str = "poisoning"

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor]:
        keys = view.keys.gather(2, kept[..., None].expand(-1, -1, -1, view.keys.shape[-1]))
        return keys, torch.full_like(keys, float("nan"))


Widening.__module__ = Poisoning.__module__ = "my_policies"  # users' policies, not evalkit's


@pytest.mark.parametrize(
    ("pol", "message"), [(Widening, r"widening .*rewrite\(\) at layer \d+ returned keys"), (Poisoning, "not finite")]
)
def test_a_rewrite_that_holds_more_than_it_keeps_or_nan_is_the_policys_fault(tiny, ids, pol, message):
    with pytest.raises(PolicyError, match=message):
        compressed(tiny.model, ids, pol(budget=0.25))


def test_out_of_range_settings_are_refused():
    for pol, message in [
        (Merging(inner=SnapKV(), similarity_threshold=1.5), "similarity_threshold=1.5"),
        (Merging(inner=SnapKV(), merge_fraction=0.0), "merge_fraction=0.0"),
        (ThinK(inner=FullCache(), channels=1.0), "channels=1.0"),
        (ThinK(inner=FullCache(), window=0), "window=0"),
        (KeyRerotation(inner=SnapKV(), decode=True), "set decode=false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            pol.validate(CTX)


class NoRotary(torch.nn.Module):
    # every layer attends fully (no layer types listed): only the missing rotary embedding is refused
    config = types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(layer_types=None))

    def get_decoder(self):
        return self


def test_key_rerotation_refuses_a_model_without_one_plain_rotary_embedding():
    with pytest.raises(ConfigError, match="re-rotates keys by one rotary embedding"):
        KeyRerotation(inner=SnapKV()).prepare(NoRotary(), None)
    with pytest.raises(ConfigError, match=r"key_rerotation\(snapkv\) needs every layer to attend to the whole context"):
        KeyRerotation(inner=SnapKV()).prepare(sliding_model(), None)  # the question would not follow in those layers


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("key_rerotation", "key_rerotation(snapkv) does not support a chunked prefill"),
        ("think", "think(none) does not support a chunked prefill"),
    ],
)
def test_a_chunked_prefill_is_refused_in_one_line(tmp_path, policy, message):
    result = run_cli("model=tiny-random", f"policy={policy}", "prefill=chunked", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("variant", ["key_rerotation/snapkv@0.5", "merging/snapkv@0.5", "think/snapkv@0.5"])
def test_the_command_line_runs_each_over_snapkv(tmp_path, variant):
    row = tiny_row(tmp_path, f"variants=[{variant}]")
    assert row["variant"] == variant.replace("/snapkv", "(snapkv)") and row["kv_bytes"] < row["kv_bytes_baseline"]


@pytest.mark.parametrize(
    "make",
    [lambda: KeyRerotation(inner=SnapKV(window=8), budget=0.25), lambda: Finch(budget=0.25)],
    ids=["key_rerotation", "finch"],
)
def test_the_question_follows_the_rerotated_keys_as_a_plain_cache_of_them_would_have_it(tiny, ids, make):
    """After a re-rotation the question takes positions k, k+1, ... (kvpress's pipeline continues from the compressed
    length): its logits equal transformers' own forward over a plain DynamicCache holding the same keys and values,
    given those positions; the question at its true positions (CTX, ...) is the control, and differs."""
    pol = make()
    _, cache = compressed(tiny.model, ids, pol)
    k = cache.layers[0].keys.shape[-2]
    assert cache.get_seq_length() == k == 24
    question = ids[:, CTX:]
    with torch.inference_mode():
        got = tiny.model(input_ids=question, cache=cache, use_cache=True, **observe(None, cache)).logits[0]
        for at, same in ((k, True), (CTX, False)):
            plain = DynamicCache(config=tiny.model.config)
            for i, layer in enumerate(compressed(tiny.model, ids, make())[1].layers):
                plain.update(layer.keys, layer.values, i)
            positions = torch.arange(at, at + question.shape[1])[None]
            want = tiny.model(input_ids=question, cache=plain, position_ids=positions).logits[0]
            assert torch.allclose(got, want, rtol=0, atol=1e-5) == same
