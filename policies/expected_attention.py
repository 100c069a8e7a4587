"""Expected Attention: keep the tokens that future queries are expected to attend to, weighted by their value norm.

Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution" (arXiv:2510.00636); reference code NVIDIA kvpress `ExpectedAttentionPress` (kvpress 0.5.5). The
queries still to come are modelled as a Gaussian: the mean mu and covariance Sigma of the layer's pre-RoPE context
queries (all of them but the first `n_sink`, whose hidden states are outliers; the covariance divided by their count),
rotated by the RoPE rotation averaged over the next `n_future_positions` positions, R = mean_p R(p) for p = T ..
T + n - 1 after a T-token prompt: mu' = R mu, Sigma' = R Sigma R^T. For a key k the expected unnormalised attention
is the Gaussian's moment generating function, E[exp(q.k / sqrt(d))] = exp(mu'.k / sqrt(d) + k^T Sigma' k / (2 d)),
normalised by a softmax over the held keys other than the sinks, per query head; the heads of a KV group are
averaged, and the result is rescaled by the value norm, (score + epsilon) * ||v||. The first `n_sink` tokens are
always kept (kvpress gives them the top score). Like kvpress, it compresses the prompt once (decode=false), and the
statistics are the whole prompt's, so it does not evict chunk by chunk.

The statistics are this file's own observation (`QueryStats`), recorded by the engine at every full-attention layer
of the prefill: the post-RoPE queries the attention sees are rotated back by their positions, the cos and sin
computed as transformers' rotary embeddings do, with the model's own RoPE frequencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.attention.observation import Attended, Observation
from evalkit.errors import ParamError
from evalkit.policies import LayerView, SinkPolicy


@dataclass
class Stats:
    """One layer's pre-RoPE query statistics and the RoPE they are rotated by again."""

    mean: Tensor  # (B, Hq, D)
    cov: Tensor  # (B, Hq, D, D), divided by the count
    inv_freq: Tensor  # (D/2,) the RoPE's frequencies
    scaling: float  # the RoPE's attention scaling


@dataclass(frozen=True)
class QueryStats(Observation):
    """Per layer: the mean and covariance (divided by the count, not count - 1) of the pre-RoPE context queries at
    positions `start` on, and the model's RoPE."""

    start: int

    def prefill(self, at: Attended) -> Stats | None:
        """Two passes (mean, then centred products) over `chunk` queries at a time: memory O(chunk x D) beyond the
        statistics. None when no query of this forward is at `start` or after."""
        inv_freq, attn_scaling = rope(at.model)
        query, tk, chunk = at.query, at.key.shape[-2], 1024
        b, hq, tq, d = query.shape
        if 2 * inv_freq.shape[-1] != d:
            raise ValueError(f"query statistics: RoPE over {2 * inv_freq.shape[-1]} of {d} head dims is not supported")
        inv_freq = inv_freq.to(query.device, torch.float32)

        def pre_rope(lo: int, hi: int) -> Tensor:  # (B, Hq, hi - lo, D): queries lo..hi-1 of this forward
            pos = torch.arange(tk - tq + lo, tk - tq + hi, device=query.device)
            return unrotate(query[:, :, lo:hi], pos, inv_freq, attn_scaling)

        first = max(0, self.start - (tk - tq))
        n = tq - first
        if n < 1:
            return None
        spans = [(lo, min(lo + chunk, tq)) for lo in range(first, tq, chunk)]
        mean = sum(pre_rope(lo, hi).sum(dim=2) for lo, hi in spans) / n  # (B, Hq, D)
        cov = query.new_zeros(b, hq, d, d, dtype=torch.float32)
        for lo, hi in spans:
            centred = pre_rope(lo, hi) - mean[:, :, None]
            cov += centred.transpose(-1, -2) @ centred
        return Stats(mean, cov / n, inv_freq, float(attn_scaling))


def rope(model: torch.nn.Module | None) -> tuple[Tensor, float]:
    """The RoPE frequencies (D/2,) and attention scaling of a model's rotary embedding (`model.model.rotary_emb`, or
    `model.rotary_emb`); with one RoPE per layer type (Gemma 3), the full-attention layers'."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        raise ValueError("query statistics: the model has no rotary embedding (rotary_emb) to undo its RoPE with")
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None:
        return rotary.full_attention_inv_freq, rotary.full_attention_attention_scaling
    return inv_freq, getattr(rotary, "attention_scaling", 1.0)


def unrotate(x: Tensor, positions: Tensor, inv_freq: Tensor, scaling: float) -> Tensor:
    """float32 `x` (..., T, D) rotated back from RoPE at `positions` (T,) or (..., T), and divided by the RoPE's
    attention scaling: the pre-RoPE queries or keys, for transformers' rotate_half layout (dimension i pairs with
    i + D/2), the angles in float32 as transformers computes them."""
    d = x.shape[-1]
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(x.device, torch.float32)  # (..., T, D/2)
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    x = x.float()
    x_half = torch.cat([x[..., d // 2 :], -x[..., : d // 2]], dim=-1)  # the inverse of rotate_half
    return (x * cos + x_half * sin) / scaling


def averaged_rotation(inv_freq: Tensor, scaling: float, start: int, n: int) -> Tensor:
    """(D, D) mean of the RoPE rotations at positions start .. start + n - 1, for transformers' rotate_half layout
    (dimension i pairs with i + D/2), each rotation times the RoPE's attention `scaling`. Angles in float32 as
    transformers computes them."""
    pos = torch.arange(start, start + n, device=inv_freq.device, dtype=torch.float32)
    angles = pos[:, None] * inv_freq.float()[None, :]  # (n, D/2)
    cos, sin = angles.cos().mean(dim=0) * scaling, angles.sin().mean(dim=0) * scaling
    half = inv_freq.shape[-1]
    rot = torch.diag(torch.cat([cos, cos]))
    rot[:half, half:] = -torch.diag(sin)  # first half: x1 cos - x2 sin
    rot[half:, :half] = torch.diag(sin)  # second half: x2 cos + x1 sin
    return rot


@dataclass(kw_only=True)
class ExpectedAttention(SinkPolicy):
    """Top-k by the attention expected from the Gaussian of future queries, times the value norm; sinks kept."""

    name: str = "expected_attention"
    n_future_positions: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    decode: bool = False  # as published: compress the prompt once
    chunkable: ClassVar[bool] = False  # the statistics are those of the whole prompt's queries
    decodable: ClassVar[bool] = False  # the future positions are those after the prompt

    def needs(self) -> tuple[QueryStats]:
        """The statistics of the queries from position n_sink on: the sinks' queries are left out."""
        return (QueryStats(self.n_sink),)

    def statistics(self, view: LayerView) -> Stats:
        """The layer's query statistics: the prompt's, as the prefill recorded them."""
        return view.observed(QueryStats(self.n_sink))

    def score(self, view: LayerView) -> Tensor:
        stats = self.statistics(view)
        mean, cov = stats.mean, stats.cov  # (B, Hq, D), (B, Hq, D, D)
        rot = averaged_rotation(stats.inv_freq, stats.scaling, view.seen, self.n_future_positions)
        mean = mean @ rot.T
        cov = rot @ cov @ rot.T
        b, hkv, t, d = view.keys.shape
        group = mean.shape[1] // hkv
        keys = view.keys.float()
        sinks = view.positions < self.n_sink  # (B, Hkv, T)
        probs = keys.new_zeros(b, hkv, t)
        for g in range(group):  # query head g of every KV group: memory O(B x Hkv x T x D)
            heads = torch.arange(hkv, device=keys.device) * group + g
            logits = (keys @ mean[:, heads, :, None]).squeeze(-1) / math.sqrt(d)
            if self.use_covariance:
                logits = logits + ((keys @ cov[:, heads]) * keys).sum(dim=-1) / (2 * d)
            probs += logits.masked_fill(sinks, float("-inf")).softmax(dim=-1)
        scores = probs / group  # the mean over the query heads of each KV group
        if self.use_vnorm:
            scores = (scores + self.epsilon) * view.values.float().norm(dim=-1)
        return scores  # the sinks are protected whatever they score

    def check_params(self) -> None:
        super().check_params()
        if self.n_future_positions < 1:
            raise ParamError(
                {"n_future_positions": self.n_future_positions},
                ": the RoPE average needs at least 1 future position; give e.g. 512",
            )
        if self.epsilon < 0:
            raise ParamError({"epsilon": self.epsilon}, " is negative; give 0.0 or a small positive number")
