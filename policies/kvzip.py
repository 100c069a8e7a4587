"""KVzip: keep the tokens the model attends to most while it reconstructs the context from the cache.

Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv:2505.23416). After
the context is prefilled, a second pass feeds, over the full cache, a repeat prompt ("Repeat the previous context
exactly.", closed by the chat template's end of the user turn and start of the answer) followed by the context itself:
the model is made to reconstruct the context, and the cached tokens it needs to do so are those it attends to. The
score of each cached key, per KV head, is the highest attention it receives from any query of that pass and any query
head of the KV group. The choice does not depend on a question, so one compressed cache serves every question.

As in the reference code (NVIDIA kvpress `KVzipPress`, after snu-mllab/KVzip): the context is reconstructed in chunks
of `chunk_size` tokens (2048); later chunks are prompted with "Repeat the part of the previous context exactly,
starting with" and the previous chunk's last 8 tokens. Each chunk's softmax runs over the first `n_sink` cached keys,
the chunk's cached keys and the pass's own keys. The chat template's opening (system turn, user header) is not
reconstructed and scores 0, except the first `n_sink` (4) tokens, which are always kept. The pass is this policy's
observation (`Reconstruction`, policies/kvzip_pass.py: every chunk one block of a single forward), which the engine
runs after the prefill; its time is recorded as `seconds.reconstruct`.

The budget is global, as published (kvpress `layerwise=False`, the default): the k x Hkv x layers highest scores of
all layers and KV heads together are kept, so layers and heads keep different counts (ragged storage, as Ada-KV).
`layerwise: true` keeps k x Hkv per layer, shared among that layer's heads by their scores (kvpress `layerwise=True`).
`plus: true` is KVzip+'s normalisation (kvpress `kvzip_plus_normalization`): each probability is divided by the norm
of the hidden state of the query that gave it and multiplied by the norm of the key's value through the output
projection of the query head. Compress once, after the prompt: no chunked prefill, no eviction while decoding.
A budget counts tokens per KV head on average: a fraction f keeps ceil(f x T) x Hkv x layers tokens in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, SinkPolicy, padded_indices
from evalkit.policies.kvzip_pass import Reconstruction


@dataclass(kw_only=True)
class RankedTogether(SinkPolicy):
    """The highest scores of all layers and KV heads ranked together (or, `layerwise`, each layer's heads together),
    sinks first: KVzip's selection, which Fast KVzip shares. Compress once, after the prompt; heads keep different
    counts. A subclass gives `score`."""

    layerwise: bool = False  # true: k x Hkv per layer, shared by its heads; false (published): ranked over all layers
    decode: bool = False  # as published: compress the prompt once
    chunkable: ClassVar[bool] = False  # its scores need the whole context
    decodable: ClassVar[bool] = False  # no scores for the tokens added after the prompt
    ragged: ClassVar[bool] = True  # heads keep different counts

    def ranked(self, view: LayerView) -> Tensor:
        """(B, Hkv, T) float32 scores to rank by: sinks first (+inf), padding last (-inf); with no sinks, each head's
        best token also ranks first, so that no head is left empty."""
        scores = self.score(view).float().masked_fill(self.protected(view, 0), math.inf)
        scores = scores.masked_fill(~view.real, -math.inf)
        if self.n_sink == 0:
            scores = scores.scatter(-1, scores.argmax(dim=-1, keepdim=True), math.inf)
        return scores

    def over(self, view: LayerView, k: int) -> bool:
        return int(view.real.sum(dim=(1, 2)).max()) > k * view.keys.shape[1]

    def total(self, slots: int, targets: list[tuple[int, int]]) -> int:
        """Tokens kept among `slots` ranked together (one layer's, or all layers'), each layer's share of the budget
        given as (k per head, KV heads): the sum of k x Hkv."""
        return sum(k * heads for k, heads in targets)

    def select(self, view: LayerView, k: int) -> Tensor:
        """(B, Hkv, kmax) ascending indices each head keeps, padded with -1: the layer's k x Hkv best across its
        heads (the layerwise setting)."""
        ranked = self.ranked(view)
        kept = top(ranked.flatten(1), self.total(ranked[0].numel(), [(k, view.keys.shape[1])]))
        return padded_indices(kept.view(ranked.shape))

    @property
    def ranks_across_layers(self) -> bool:
        """The published ranking is over all layers and heads; `layerwise` ranks within each layer (`select`)."""
        return not self.layerwise

    def select_layers(self, views: dict[int, LayerView], targets: dict[int, int]) -> dict[int, Tensor]:
        ranked = {i: self.ranked(view) for i, view in views.items()}
        flat = torch.cat([r.flatten(1) for r in ranked.values()], dim=1)  # (B, all layers' slots)
        kept = top(flat, self.total(flat.shape[1], [(targets[i], view.keys.shape[1]) for i, view in views.items()]))
        out, offset = {}, 0
        for i, r in ranked.items():
            out[i] = padded_indices(kept[:, offset : offset + r[0].numel()].view(r.shape))
            offset += r[0].numel()
        return out


@dataclass(kw_only=True)
class KVzip(RankedTogether):
    """The highest scores of the reconstruction pass, ranked over all layers and KV heads (or per layer); sinks kept."""

    name: str = "kvzip"
    chunk_size: int = 2048  # context tokens reconstructed per pass
    plus: bool = False  # KVzip+ normalisation (kvpress kvzip_plus_normalization)

    def needs(self) -> tuple[Reconstruction]:
        """The reconstruction pass it scores with."""
        return (Reconstruction(self.n_sink, self.chunk_size, self.plus),)

    def score(self, view: LayerView) -> Tensor:
        scores = view.observed(self.needs()[0])  # (B, Hkv, tokens prefilled)
        return scores.gather(-1, view.positions.clamp(min=0))

    def check_params(self) -> None:
        super().check_params()
        if self.chunk_size < 1:
            raise ParamError({"chunk_size": self.chunk_size}, ": a pass reconstructs at least 1 token; e.g. 2048")


def top(scores: Tensor, k: int) -> Tensor:
    """(B, N) bool: the k highest of each row of scores (B, N)."""
    kept = torch.zeros_like(scores, dtype=torch.bool)
    return kept.scatter_(1, scores.topk(min(k, scores.shape[1]), dim=1).indices, True)
