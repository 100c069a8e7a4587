"""ChunkKV: keep whole fixed-size chunks of the context, ranked by the scores of any other policy.

Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference"
(arXiv:2502.00299). A wrapper: the inner policy (SnapKV by default, as in the paper) scores every held token; the
tokens are grouped into chunks of `chunk_size` consecutive positions (chunk i = positions [i*c, (i+1)*c), counted
from the first token of the context), each chunk is ranked by the sum of its tokens' scores, and the best chunks are
kept whole, so that a phrase is kept or dropped together.

The rule, per layer and KV head, when keeping k tokens:

1. the inner policy's protected tokens (SnapKV's observation window, StreamingLLM's sinks, ...) are kept first;
2. the other held tokens (the candidates) form the chunks. A chunk's score is the sum of its candidates' scores;
   a chunk with fewer candidates than `chunk_size` (the last one, one cut by the protected tokens, one thinned by
   an earlier eviction) is ranked by its mean times `chunk_size`, which is its sum when it is whole (kvpress's
   ChunkKVPress ranks a partial chunk by its mean too). Ties go to the earlier chunk;
3. chunks are kept whole in rank order while they fit; the first that does not fit entirely gives its
   highest-scoring candidates to fill the budget exactly (whole chunks, then the best partial one). The paper's
   code keeps floor(budget / chunk_size) whole chunks and so holds up to chunk_size - 1 tokens fewer than asked;
   here the budget holds exactly, like every other policy.

`per_head=false` (the default, as kvpress's ChunkKVPress, which sums the scores over the heads): the scores are
summed over the layer's KV heads, so every head of a layer keeps the same chunks. `per_head=true`: each KV head
ranks its own chunks. The paper's layer-wise index reuse (sharing one layer's choice with the next) is not
implemented.

What the wrapper needs observed, its observation window, its protected tokens, its per-layer budgets and whether it
supports a chunked prefill or decode-time eviction are the inner policy's. The inner policy takes the wrapper's
budget and decode setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, Wrapper, checked_scores, kept_protected


@dataclass(kw_only=True)
class ChunkKV(Wrapper):
    """Whole chunks of `chunk_size` tokens ranked by the inner policy's summed scores; the budget exact."""

    name: str = "chunkkv"  # recorded as chunkkv(INNER), e.g. chunkkv(snapkv)
    chunk_size: int = 10  # the paper's default
    per_head: bool = False

    # --- the choice ----------------------------------------------------------------------------------------------

    def select(self, view: LayerView, k: int) -> Tensor:
        scores = checked_scores(self.inner, self.inner.score(view), view)  # (B, Hkv, T)
        b, h, t = scores.shape
        protected = kept_protected(self, view, k)
        if protected is None:
            protected = torch.zeros_like(scores, dtype=torch.bool)
        candidate = ~protected
        chunk = torch.div(view.positions, self.chunk_size, rounding_mode="floor").long()  # (B, Hkv, T)
        n_chunks = math.ceil(view.seen / self.chunk_size)
        sums = scores.new_zeros(b, h, n_chunks).scatter_add_(2, chunk, scores.masked_fill(protected, 0.0))
        counts = scores.new_zeros(b, h, n_chunks).scatter_add_(2, chunk, candidate.float())
        # The heads of a layer rank their chunks together, and their tokens by the summed score, when they hold the
        # same positions (always at the end of a prefill, and then after every eviction of this policy).
        same = not self.per_head and bool((view.positions == view.positions[:, :1]).all())
        token_scores = scores
        if not self.per_head:
            sums, counts = sums.sum(1, keepdim=True), counts.sum(1, keepdim=True)
            if same:
                token_scores = scores.sum(1, keepdim=True).expand(b, h, t)
        # mean x chunk_size: the sum for a whole chunk; a chunk without candidates ranks last
        chunk_score = (sums / counts.clamp(min=1) * self.chunk_size).masked_fill(counts == 0, -math.inf)
        order = chunk_score.argsort(dim=-1, descending=True, stable=True)  # best chunk first, ties: earlier
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n_chunks, device=order.device).expand_as(order))
        token_rank = rank.expand(b, h, n_chunks).gather(2, chunk).masked_fill(protected, -1)  # protected: first
        # Candidates by score within their chunk (stable: ties to the earlier position), then chunks by rank.
        by_score = token_scores.argsort(dim=-1, descending=True, stable=True)
        by_chunk = token_rank.gather(-1, by_score).argsort(dim=-1, stable=True)
        kept = by_score.gather(-1, by_chunk)[..., :k]
        return kept.sort(dim=-1).values

    def check_params(self) -> None:
        if self.chunk_size < 1:
            raise ParamError({"chunk_size": self.chunk_size}, ": a chunk holds at least 1 token; e.g. 10")
        super().check_params()
