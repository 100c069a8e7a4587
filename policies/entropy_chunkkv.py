"""Entropy-gated ChunkKV: whole chunks ranked by an inner scorer, but a spiky important chunk gives up all but its best.

kvpress's EntropyGatedChunkKVPress (after ChunkKV, Liu et al. 2025, arXiv:2502.00299). As `chunkkv`, the layer's KV
heads keep the same tokens, chosen from the inner scores summed over the heads, in chunks of `chunk_size` positions
(the last may be shorter). Each chunk has a score, the mean of its tokens' scores, and an entropy, that of its
tokens' scores as a distribution (shifted to be non-negative when a score is negative) over log(its length), in
[0, 1]. Chunks are visited best score first while the budget lasts; each is kept whole, except one at or above the
median score and below the median entropy (important, but its weight on a few tokens), which keeps only its
`low_entropy_chunk` best tokens; the budget left at the end goes to the best tokens not yet kept. The budget holds
exactly.

The inner policy's protected tokens (SnapKV's observation window) are not kept whatever the scores: they score the
layer's highest score, as kvpress's SnapKVPress pads its window with its highest score, and the rule decides. Like
kvpress's press it compresses the prompt once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, Wrapper, checked_scores

EPSILON = 1e-8  # in the entropy's normalisation and logarithm, as kvpress's


def entropy(scores: Tensor) -> Tensor:
    """(..., n) -> (...): the normalised entropy in [0, 1] of each row of scores taken as a distribution (shifted up
    by its minimum when that is negative); a row of one token: 0."""
    n = scores.shape[-1]
    if n == 1:
        return scores.new_zeros(scores.shape[:-1])
    shifted = scores - scores.amin(dim=-1, keepdim=True).clamp(max=0.0)
    p = shifted / (shifted.sum(dim=-1, keepdim=True) + EPSILON)
    return (-(p * (p + EPSILON).log()).sum(dim=-1) / math.log(n)).clamp(0.0, 1.0)


def gated_choice(scores: Tensor, k: int, chunk: int, low: int) -> Tensor:
    """(T,) bool: the k positions kept from one layer's summed scores (T,), by the rule of the module doc."""
    t = scores.shape[0]
    whole = t // chunk * chunk
    bounds = [(lo, min(lo + chunk, t)) for lo in range(0, t, chunk)]
    means = [scores[:whole].view(-1, chunk).mean(dim=1)] + ([scores[whole:].mean()[None]] if whole < t else [])
    spread = [entropy(scores[:whole].view(-1, chunk))] + ([entropy(scores[whole:])[None]] if whole < t else [])
    mean, ent = torch.cat(means), torch.cat(spread)
    important, spiky = (mean >= mean.median()).tolist(), (ent < ent.median()).tolist()
    keep = torch.zeros(t, dtype=torch.bool, device=scores.device)
    left = k
    for c in mean.argsort(descending=True, stable=True).tolist():
        if left <= 0:
            break
        lo, hi = bounds[c]
        n = min(hi - lo, left, low) if important[c] and spiky[c] else min(hi - lo, left)
        keep[lo + scores[lo:hi].topk(n).indices] = True
        left -= n
    if left > 0:  # a spiky chunk's budget, spent on the best tokens not kept
        rest = (~keep).nonzero().squeeze(-1)
        keep[rest[scores[rest].topk(min(left, rest.numel())).indices]] = True
    return keep


@dataclass(kw_only=True)
class EntropyGatedChunkKV(Wrapper):
    """The layer's chunks by the inner policy's summed scores, spiky important ones cut to their best tokens."""

    name: str = "entropy_chunkkv"  # recorded as entropy_chunkkv(INNER)
    chunk_size: int = 10
    low_entropy_chunk: int = 4  # tokens a spiky important chunk keeps
    decode: bool = False  # compresses the prompt once

    chunkable: ClassVar[bool] = False  # the chunks and medians are the whole prompt's
    decodable: ClassVar[bool] = False

    def protected(self, view: LayerView, k: int) -> None:
        return None  # the inner policy's protected tokens score the highest score instead (module doc)

    def select(self, view: LayerView, k: int) -> Tensor:
        scores = checked_scores(self.inner, self.inner.score(view), view)  # (B, Hkv, T)
        b, h, t = scores.shape
        protected = self.inner.protected(view, k)
        if protected is not None and bool(protected.any()) and not bool(protected.all()):
            scores = scores.masked_fill(protected, float(scores.masked_fill(protected, -math.inf).max()))
        summed = scores.sum(dim=1)  # (B, T): the heads hold the same positions (a prefill method)
        keep = torch.stack([gated_choice(s, k, self.chunk_size, self.low_entropy_chunk) for s in summed])
        kept = keep.nonzero()[:, 1].view(b, 1, -1)  # ascending within each batch row
        return kept.expand(b, h, kept.shape[-1])

    def check_params(self) -> None:
        if not self.chunk_size > self.low_entropy_chunk >= 1:
            raise ParamError(
                {"chunk_size": self.chunk_size, "low_entropy_chunk": self.low_entropy_chunk},
                ": a spiky chunk keeps fewer tokens than a chunk holds and at least one (10 and 4)",
            )
        super().check_params()
