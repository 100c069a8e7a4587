"""Leverage scores (leverage) and Compactor's blend (compactor) against references written out here: the hat matrix's
diagonal worked by hand, the float64 hat matrix of the same sketch, RoPE undone against transformers' own rotation,
and the blend recomputed from its parts; the identity test and the cache invariants cover both with every policy in
conf/policy (tests/test_cache_invariants.py), kvpress's choices on the real model in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from evalkit.attention.observation import Attended
from evalkit.errors import ConfigError
from evalkit.policies import LayerView
from evalkit.policies.compactor import Compactor
from evalkit.policies.expected_attention import unrotate
from evalkit.policies.leverage import LeverageScore, leverage
from evalkit.policies.non_causal import ChunkAttention
from tests.conftest import pool_by_hand, run_cli
from tests.test_attention_free_scorers import loop_reference

INV_FREQ = torch.tensor([1.0, 0.1])  # a RoPE over 4 head dims


def rotated(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`x` (B, H, T, D) at `positions` (T,) under transformers' own RoPE (apply_rotary_pos_emb, rotate_half)."""
    angles = positions.float()[:, None] * INV_FREQ[None, :]
    emb = torch.cat([angles, angles], dim=-1)[None]  # (1, T, D)
    out, _ = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin())
    return out


def test_unrotate_undoes_transformers_rope():
    torch.manual_seed(0)
    x, pos = torch.randn(1, 2, 7, 4), torch.arange(3, 10)
    torch.testing.assert_close(unrotate(rotated(x, pos), pos, INV_FREQ, 1.0), x, rtol=1e-5, atol=1e-5)
    # per-head positions (B, H, T), as a layer view holds them
    torch.testing.assert_close(unrotate(rotated(x, pos), pos.expand(1, 2, 7), INV_FREQ, 1.0), x, rtol=1e-5, atol=1e-5)


def test_leverage_is_the_hat_matrix_diagonal_by_hand():
    """Centred keys (1,0) (-1,0) (1,0) (-1,0) (0,1) (0,-1): X^T X = diag(4, 2), so x (X^T X)^-1 x^T is 1/4 for the
    first four and 1/2 for the last two. A square sketch (2 x 2, invertible) leaves the hat matrix unchanged: the
    sketch only approximates when it has fewer columns than the keys have channels."""
    keys = torch.tensor([[[[1.0, 0], [-1, 0], [1, 0], [-1, 0], [0, 1], [0, -1]]]]) + 5.0  # centring removes the 5
    sketch = torch.tensor([[[[0.7, -1.3], [0.4, 2.1]]]])
    torch.testing.assert_close(leverage(keys, sketch, 1e-9)[0, 0], torch.tensor([0.25] * 4 + [0.5] * 2))


def hat_diagonal(keys: torch.Tensor, sketch: torch.Tensor, jitter: float) -> torch.Tensor:
    """(T,) diag(X (X^T X + jitter I)^-1 X^T) in float64 with an explicit inverse, X = (keys - mean) @ sketch, one
    head."""
    x = (keys.double() - keys.double().mean(dim=0)) @ sketch.double()
    inv = torch.linalg.inv(x.T @ x + jitter * torch.eye(x.shape[1], dtype=torch.float64))
    return torch.stack([x[i] @ inv @ x[i] for i in range(x.shape[0])]).clamp_min(0)


def draw(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The sketch as the policies document it: N(0, 1/k) entries drawn from a generator seeded with `seed`."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) / math.sqrt(shape[-1])


def view(keys: torch.Tensor, values: torch.Tensor, layer_idx: int = 0, observations=None) -> LayerView:
    b, h, t, _ = keys.shape
    return LayerView(layer_idx, 2, t, keys, values, torch.arange(t).expand(b, h, t), {}, observations or {})


def test_leverage_policy_scores_the_pre_rope_keys_with_layer_seeded_sketches():
    """The policy's scores are the float64 hat diagonal of the pre-RoPE keys (transformers' rotation undone) under the
    sketch drawn from seed + layer; another seed keeps another set."""
    torch.manual_seed(1)
    pre = torch.randn(1, 2, 40, 4) * torch.tensor([3.0, 1.0, 0.5, 0.1])
    post = rotated(pre, torch.arange(40))
    pol = LeverageScore(budget=10, sketch=3, seed=7)
    pol.rope = (INV_FREQ, 1.0)
    got = pol.score(view(post, torch.randn(1, 2, 40, 4), layer_idx=1))
    sketch = draw(8, (1, 2, 4, 3))  # seed 7 + layer 1
    for h in range(2):
        torch.testing.assert_close(got[0, h], hat_diagonal(pre[0, h], sketch[0, h], 0.01).float(), rtol=1e-4, atol=1e-5)
    other = LeverageScore(budget=10, sketch=3, seed=8)
    other.rope = (INV_FREQ, 1.0)
    v = view(post, torch.randn(1, 2, 40, 4), layer_idx=1)
    assert not torch.equal(pol.select(v, 10), other.select(v, 10))


def test_leverage_without_its_rope_read_is_refused():
    with pytest.raises(ValueError, match=r"prepare\(\) was not called"):
        LeverageScore(budget=4).score(view(torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)))


def z(x: torch.Tensor) -> torch.Tensor:
    """z-score over every entry, the standard deviation with n - 1, in float64."""
    x = x.double()
    return (x - x.mean()) / math.sqrt(float(((x - x.mean()) ** 2).sum()) / (x.numel() - 1))


def test_compactor_blends_z_scored_leverage_and_chunked_attention_between_both_ends_sinks():
    """30 tokens, 2 sinks at the start and 3 at the end, chunks of 8 over the 25 between, 2 query heads per KV head:
    each term recomputed from its definition (float64 hat diagonal; the plain loop of the chunked attention, averaged
    over the group, times the value norm, pooled over 3), z-scored over the layer, blended with 0.3."""
    torch.manual_seed(2)
    t, s0, s1 = 30, 2, 3
    pre = torch.randn(1, 2, t, 4)
    keys, values, queries = rotated(pre, torch.arange(t)), torch.randn(1, 2, t, 4), torch.randn(1, 4, t, 4)
    pol = Compactor(budget=12, sink_start=s0, sink_end=s1, chunk=8, sketch=3, seed=0, blending=0.3)
    pol.rope = (INV_FREQ, 1.0)
    (obs,) = pol.needs()
    assert obs == ChunkAttention(8, (s0, s1))
    v = view(keys, values, observations={obs: obs.prefill(Attended(None, queries, keys, 1.0, t))})
    got = pol.score(v)

    mid = slice(s0, t - s1)
    sketch = draw(0, (1, 2, 4, 3))
    lev = torch.stack([hat_diagonal(pre[0, h, mid], sketch[0, h], 0.01) for h in range(2)])

    def group_mean(h: int) -> torch.Tensor:  # KV head h's two query heads, each by the plain loop
        k = keys[0, h, mid].tolist()
        return torch.tensor([loop_reference(queries[0, q, mid].tolist(), k, 8) for q in (2 * h, 2 * h + 1)]).mean(0)

    received = torch.stack([group_mean(h) for h in range(2)]).double()
    attn = pool_by_hand(received * values[0, :, mid].double().norm(dim=-1), 3, "avg")
    want = 0.3 * z(lev) + z(attn)
    torch.testing.assert_close(got[0, :, mid].double(), want, rtol=1e-4, atol=1e-4)
    kept = pol.select(v, 12)[0]
    for h in range(2):  # the sinks of both ends, then the 7 best of the middle
        best = sorted((want[h].topk(7).indices + s0).tolist())
        assert kept[h].tolist() == sorted([0, 1, *best, 27, 28, 29])


def test_compactor_blends_by_the_share_evicted_unless_told():
    """blending null: 1 - budget, as kvpress blends by its compression ratio; the weight changes what is kept."""
    torch.manual_seed(3)
    t = 64
    keys, values, queries = torch.randn(1, 1, t, 4), torch.randn(1, 1, t, 4), torch.randn(1, 1, t, 4)
    picks = {}
    for blending in (None, 0.75, 0.0):
        pol = Compactor(budget=0.25, chunk=16, sketch=4, blending=blending)
        pol.rope = (INV_FREQ, 1.0)
        (obs,) = pol.needs()
        v = view(keys, values, observations={obs: obs.prefill(Attended(None, queries, keys, 1.0, t))})
        picks[blending] = pol.select(v, 16).tolist()
    assert picks[None] == picks[0.75] != picks[0.0]


def test_leverage_and_compactor_are_prefill_methods_refused_in_one_line(tmp_path):
    assert Compactor().min_tokens() == 13
    for args, message in [
        (["policy=compactor", "prefill=chunked"], "compactor does not support a chunked prefill"),
        (["policy=leverage", "policy.sketch=0"], "policy.sketch=0: give the sketch's columns, such as 48"),
        (["policy=compactor", "policy.decode=true"], "compactor compresses once, after the prompt"),
    ]:
        result = run_cli("model=tiny-random", *args, f"hydra.run.dir={tmp_path}")
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    with pytest.raises(ConfigError, match="^jitter=0"):
        LeverageScore(jitter=0.0).validate(None)
