"""KVCompose: structured compression, the same number of tokens in every KV head of a layer, layers sharing the budget
by composite scores.

Akulov et al. 2025, "KVCompose: Efficient Structured KV Cache Compression with Composite Tokens" (arXiv:2509.05165),
as kvpress's KVComposePress (its structured setting): the context is read a second time over the full cache, and each
query head's attention to every context token is aggregated over the repeated queries (`agg_task`: max or mean),
then over the query heads of a KV group (`agg_group`); with `add_v_norm` times the norm of the token's value; with
`add_mean_across_heads` plus the layer's mean over its KV heads. A layer's composite score at rank r is the
`agg_head` over its KV heads of each head's r-th highest score (the first layer's: the highest of any layer at r);
the budget's tokens go to the best ranks of all layers together (every layer keeps at least one, and its first
`keep_token_lower_bound` ranks), and each KV head of a layer keeps its own best tokens, that layer's count of them:
heads keep different tokens, every head of a layer the same number, so the cache stays a plain tensor.

The second read is this policy's observation (`RepeatAttention`): one forward of the context over the full cache,
read in place, its attention recorded as it goes; kvpress runs it in eager attention and lets the cache grow by the
repeat. Every layer must attend to the whole context (sliding-window models are refused). With `structured: false`
(kvpress's unstructured setting) each head's own ranked scores compete over all layers and heads, and each head keeps
its own count of its best: a layer's heads then differ (a ragged layer, padded; kvpress masks the evicted keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from evalkit.attention.observation import Attended, Observation
from evalkit.attention.sdpa import observe
from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView, Probes, full_attention_only, padded_indices
from evalkit.policies.kvzip_pass import READ_CHUNK, ReadOnlyLayer, pass_probs

AGGREGATES = ("max", "mean")
FIRST = 1e9  # added to the ranks kept whatever they score (keep_token_lower_bound), as kvpress adds it


@dataclass
class Aggregating:
    """A recorder for the repeat's forward: per layer, (B, Hq, n) each query head's attention to the n context tokens,
    aggregated over the repeated queries (`agg`), each softmax over the whole cache and the repeat's own keys."""

    n: int
    agg: str
    got: dict[int, Tensor] = field(default_factory=dict)

    def wants_mass(self, layer_idx: int, layer) -> bool:
        return False

    def record(self, layer_idx: int, layer, at: Attended) -> None:
        b, hq, m, _ = at.query.shape
        keys = at.key.float().repeat_interleave(hq // at.key.shape[1], dim=1)  # (B, Hq, n + m, D)
        total = torch.full((b, hq, self.n), -math.inf if self.agg == "max" else 0.0, device=at.query.device)
        for start in range(0, m, READ_CHUNK):
            probs = pass_probs(at, keys, start, min(start + READ_CHUNK, m))[..., : self.n]
            total = torch.maximum(total, probs.amax(dim=2)) if self.agg == "max" else total + probs.sum(dim=2)
        self.got[layer_idx] = total if self.agg == "max" else total / m


@dataclass(frozen=True)
class RepeatAttention(Observation):
    """Per full-attention layer, (B, Hq, n_context): each query head's attention to every context token while the
    context is read again over the full cache, aggregated over the repeated queries by `agg` (max or mean)."""

    agg: str
    pass_name: ClassVar[str] = "repeat"

    @torch.inference_mode()
    def second_pass(self, model: torch.nn.Module, full: Cache, context: Tensor, prompt) -> dict[int, Tensor]:
        n = context.shape[1]
        recorder = Aggregating(n, self.agg)
        cache = Cache(layers=[ReadOnlyLayer(layer.keys, layer.values) for layer in full.layers])
        positions = torch.arange(n, 2 * n, device=context.device)[None]
        model(input_ids=context, position_ids=positions, cache=cache, logits_to_keep=1, **observe(recorder, cache))
        return recorder.got


def aggregate(x: Tensor, how: str, dim: int) -> Tensor:
    return x.amax(dim=dim) if how == "max" else x.mean(dim=dim)


@dataclass(kw_only=True)
class KVCompose(KVPolicy):
    """Per layer a count of tokens from composite scores ranked over all layers; each KV head its own best."""

    name: str = "kvcompose"
    agg_task: str = "max"  # over the repeated queries
    agg_group: str = "mean"  # over the query heads of a KV group
    agg_head: str = "mean"  # over a layer's KV heads, rank by rank (the composite score)
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0
    structured: bool = True  # False: every KV head of every layer its own count (kvpress's unstructured setting)
    decode: bool = False
    chunkable: ClassVar[bool] = False  # its scores need the whole context read again
    decodable: ClassVar[bool] = False
    ranks_across_layers: ClassVar[bool] = True  # its composite ranking spans every layer (select_layers)

    @property
    def ragged(self) -> bool:  # type: ignore[override]
        return not self.structured  # unstructured: heads of a layer keep different counts

    def needs(self) -> tuple[RepeatAttention]:
        return (RepeatAttention(self.agg_task),)

    def prepare(self, model, probes: Probes) -> dict | None:
        full_attention_only(model, "kvcompose", "choose another policy")
        return None

    def score(self, view: LayerView) -> Tensor:
        """(B, Hkv, T) each KV head's scores: the repeat's attention over its group, the value norm, the layer's
        mean."""
        heads = view.observed(self.needs()[0])  # (B, Hq, tokens prefilled)
        b, hkv = view.keys.shape[:2]
        per_head = heads.gather(-1, view.positions.clamp(min=0).repeat_interleave(heads.shape[1] // hkv, dim=1))
        scores = aggregate(per_head.view(b, hkv, -1, per_head.shape[-1]), self.agg_group, dim=2)
        if self.add_v_norm:
            scores = scores * view.values.float().norm(dim=-1)
        if self.add_mean_across_heads:
            scores = scores + scores.mean(dim=1, keepdim=True)
        return scores

    def total(self, targets: dict[int, int]) -> int:
        """Ranks kept over all layers: each layer's share of the budget summed."""
        return sum(targets.values())

    def select_layers(self, views: dict[int, LayerView], targets: dict[int, int]) -> dict[int, Tensor]:
        scores = {i: self.score(view) for i, view in views.items()}
        ranked = {i: s.sort(dim=-1, descending=True) for i, s in scores.items()}  # each head's, best first
        if not self.structured:
            return self.unstructured(ranked, targets)
        composite = {i: aggregate(r.values, self.agg_head, dim=1) for i, r in ranked.items()}  # (B, T) per layer
        for c in composite.values():
            c[:, : self.keep_token_lower_bound] += FIRST
        first = min(composite)
        composite[first] = torch.stack(list(composite.values())).amax(dim=0)  # the first layer: the highest of any
        flat = torch.cat(list(composite.values()), dim=1)  # (B, layers x T)
        best = flat.topk(min(self.total(targets), flat.shape[1]), dim=1).indices
        t = flat.shape[1] // len(composite)  # every layer holds the prompt's T tokens: rank r of layer j is j x T + r
        counts = torch.bincount(best[0] // t, minlength=len(composite))
        counts = counts.clamp(min=max(1, self.keep_token_lower_bound))  # no layer left empty
        kept = zip(views, counts.tolist(), strict=True)
        return {i: scores[i].topk(k, dim=-1).indices.sort(dim=-1).values for i, k in kept}

    def unstructured(self, ranked: dict[int, torch.return_types.sort], targets: dict[int, int]) -> dict[int, Tensor]:
        """kvpress's unstructured setting: every head's own ranked scores (its first `keep_token_lower_bound` ranks
        first) compete over all layers and heads for the budget's tokens (each layer's share x its heads); each head
        keeps its own best, its count of them (heads of a layer differ: padded with -1)."""
        per_head = torch.stack([r.values for r in ranked.values()], dim=1)  # (B, layers, Hkv, T)
        b, layers, hkv, t = per_head.shape
        per_head[..., : self.keep_token_lower_bound] += FIRST
        per_head = per_head.reshape(b, -1)
        best = per_head.topk(min(self.total(targets) * hkv, per_head.shape[1]), dim=1).indices
        counts = torch.bincount(best[0] // t, minlength=layers * hkv).view(layers, hkv)
        out = {}
        for (i, r), count in zip(ranked.items(), counts, strict=True):
            first = torch.arange(t, device=count.device) < count[:, None]  # (Hkv, T): each head's first `count` ranks
            mask = torch.zeros_like(r.indices, dtype=torch.bool).scatter(-1, r.indices, first.expand_as(r.indices))
            out[i] = padded_indices(mask)
        return out

    def check_params(self) -> None:
        for key in ("agg_task", "agg_group", "agg_head"):
            if getattr(self, key) not in AGGREGATES:
                raise ParamError({key: getattr(self, key)}, f": give one of {list(AGGREGATES)}")
        if self.keep_token_lower_bound < 0:
            raise ParamError({"keep_token_lower_bound": self.keep_token_lower_bound}, ": give 0 or more tokens")
