"""Non-causal chunked attention: the attention each key receives from every query of its chunk, before and after it.

Chari & Van Durme 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
(arXiv:2507.08143), its attention term. The prompt is cut into chunks of `chunk` tokens; within a chunk every query
attends to every key of the chunk, without the causal mask and without the 1/sqrt(D) scaling (as the paper's and
kvpress's NonCausalAttnPress). A key's score is the attention it receives, summed over its chunk's queries and
averaged over the query heads of its KV group, times the norm of its value, smoothed over 3 neighbours (average
pooling, zero-padded at the ends).

The last chunk, when shorter, is scored as kvpress scores it: padded to `chunk` tokens with padding keys of logit 0
(which take a share of every real query's softmax) and padding queries that attend uniformly (which add to every real
key of the chunk). Memory: one chunk's (Hq, chunk, chunk) scores at a time, beyond the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from evalkit.attention.observation import Attended, Observation
from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView


def chunk_column_sums(query: Tensor, key: Tensor, chunk: int) -> Tensor:
    """(B, Hq, S): per key, the unscaled softmax attention it receives from the queries of its chunk, all of them
    (no causal mask); query (B, Hq, S, D) and key (B, Hkv, S, D) of the same S tokens. The shorter last chunk is
    padded as the module doc says."""
    b, hq, s, _ = query.shape
    group = hq // key.shape[1]
    out = query.new_zeros(b, hq, s, dtype=torch.float32)
    for lo in range(0, s, chunk):
        hi = min(lo + chunk, s)
        q = query[:, :, lo:hi]
        k = key[:, :, lo:hi].repeat_interleave(group, dim=1)
        logits = (q @ k.transpose(-1, -2)).float()  # (B, Hq, n, n)
        pad = chunk - (hi - lo) if hi == s else 0
        if pad:  # padding keys of logit 0 in every real query's softmax; each padding query spreads 1 evenly
            logits = torch.cat([logits, logits.new_zeros(*logits.shape[:-1], pad)], dim=-1)
            out[:, :, lo:hi] = logits.softmax(dim=-1)[..., : hi - lo].sum(dim=-2) + pad / chunk
        else:
            out[:, :, lo:hi] = logits.softmax(dim=-1).sum(dim=-2)
    return out


@dataclass(frozen=True)
class ChunkAttention(Observation):
    """Per layer: chunk_column_sums of the prompt's queries over its keys, (B, Hkv, S), averaged over each KV group's
    query heads; recorded at the prefill of the whole prompt only (its queries and keys are the same tokens). With
    `skip` (first, last): over the prompt less its first and last tokens, the chunks starting after the first
    (Compactor's sinks), S = prompt - first - last."""

    chunk: int
    skip: tuple[int, int] = (0, 0)

    def prefill(self, at: Attended) -> Tensor | None:
        if at.query.shape[-2] != at.key.shape[-2]:
            return None  # a later chunk of a chunked prefill (refused by the policy, chunkable=False)
        lo, hi = self.skip[0], at.key.shape[-2] - self.skip[1]
        sums = chunk_column_sums(at.query[:, :, lo:hi], at.key[:, :, lo:hi], self.chunk)
        b, hq, s = sums.shape
        return sums.view(b, at.key.shape[1], hq // at.key.shape[1], s).mean(dim=2)


def by_value(received: Tensor, values: Tensor) -> Tensor:
    """(B, Hkv, S) the attention each token received times its value norm, average-pooled over 3 tokens (the zero
    padding at the ends counted): the non-causal attention term, for values (B, Hkv, S, D) of the same tokens."""
    return F.avg_pool1d(received * values.float().norm(dim=-1), kernel_size=3, stride=1, padding=1)


@dataclass(kw_only=True)
class NonCausalAttention(KVPolicy):
    """Per KV head: top-k by non-causal chunked attention received, times the value norm, pooled over 3 tokens."""

    name: str = "non_causal_attn"
    chunk: int = 256
    decode: bool = False

    chunkable: ClassVar[bool] = False  # its chunks are the prompt's, every query of a chunk seen at once
    decodable: ClassVar[bool] = False  # a prefill method: a new token has no chunk of queries after it

    def needs(self) -> tuple[ChunkAttention]:
        return (ChunkAttention(self.chunk),)

    def score(self, view: LayerView) -> Tensor:
        return by_value(view.observed(ChunkAttention(self.chunk)), view.values)

    def check_params(self) -> None:
        if self.chunk < 1:
            raise ParamError({"chunk": self.chunk}, ": give the tokens of a chunk, such as 256")
