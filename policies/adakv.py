"""Ada-KV: one budget per layer, shared out among its KV heads by their scores, with a floor per head.

Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference"
(arXiv:2407.11550). A wrapper: the inner policy (SnapKV, TOVA, KeyDiff, Expected Attention, ...) scores every token
of every KV head; instead of each head keeping its own top k, the layer keeps the top `k x Hkv` scores across all of
its heads, so a head whose attention is concentrated gives up slots to one whose attention is spread. The paper's
safeguard (its `alpha`, kvpress's AdaKVPress `alpha_safeguard=0.2`): each head first keeps its
`max(1, int(alpha x k))` best tokens whatever the other heads score. The inner policy's protected tokens (SnapKV's
window, sinks) are kept in every head and counted in that head's share.

Heads then hold different counts: the layer is stored ragged (evalkit.kv.cache), padded to its longest head, the
padding masked out of the attention. Records give both the tokens really held (`kv_bytes_deployed`,
`tokens_held_per_layer`: the mean per head, what a paged engine stores) and what is allocated here (`kv_bytes`,
`tokens_allocated_per_layer`). Like kvpress's AdaKVPress, it compresses once, after the prompt. Scores are compared
across heads as the inner policy gives them (kvpress does the same); the paper's own code uses SnapKV's normalised
attention, whose scale is shared by the heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, Wrapper, checked_scores, kept_protected, padded_indices


def shared_out(wrapper: Wrapper, view: LayerView, k: int) -> tuple[Tensor, Tensor]:
    """The inner policy's scores (B, Hkv, T) with the protected tokens and each head's floor of int(alpha x k) best
    at +inf (padding slots at -inf), and the (B, Hkv, T) mask of the layer's top k x Hkv of them across its heads."""
    scores = checked_scores(wrapper.inner, wrapper.inner.score(view), view)
    b, h, t = scores.shape
    protected = kept_protected(wrapper, view, k)
    if protected is not None:
        scores = scores.masked_fill(protected, math.inf)
    if view.valid is not None:
        scores = scores.masked_fill(~view.valid, -math.inf)
    floor = max(1, int(wrapper.alpha * k)) if wrapper.alpha > 0 else 0
    if floor:  # each head's best `floor` tokens (its protected ones first) rank above every other score
        scores = scores.scatter(-1, scores.topk(floor, dim=-1).indices, math.inf)
    kept = torch.zeros(b, h * t, dtype=torch.bool, device=scores.device)
    kept.scatter_(1, scores.reshape(b, h * t).topk(k * h, dim=-1).indices, True)
    return scores, kept.view(b, h, t)


@dataclass(kw_only=True)
class AdaKV(Wrapper):
    """The layer's top k x Hkv inner scores across its KV heads, each head keeping at least int(alpha x k)."""

    name: str = "adakv"  # recorded as adakv(INNER)
    alpha: float = 0.2  # the per-head floor, as a fraction of the uniform per-head budget (kvpress: alpha_safeguard)
    decode: bool = False  # as published: compress the prompt once
    decodable: ClassVar[bool] = False
    chunkable: ClassVar[bool] = False
    ragged: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False  # its choice is its selection, not a score a wrapper could use

    def over(self, view: LayerView, k: int) -> bool:
        return int(view.real.sum(dim=(1, 2)).max()) > k * view.keys.shape[1]

    def select(self, view: LayerView, k: int) -> Tensor:
        """(B, Hkv, kmax) ascending indices each head keeps, padded with -1 after its last (heads keep different
        counts, k x Hkv in all)."""
        return padded_indices(shared_out(self, view, k)[1])

    def check_params(self) -> None:
        check_alpha(self.alpha)
        super().check_params()


def check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ParamError({"alpha": alpha}, ": the per-head floor is a fraction in [0, 1], e.g. 0.2")
