"""Compactor: approximate leverage of the keys blended with non-causal chunked attention, sinks kept at both ends.

Chari & Van Durme 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
(arXiv:2507.08143), as kvpress's CompactorPress computes it. The first `sink_start` and last `sink_end` tokens of the
prompt are kept first; over the tokens between them, a token's score is

    blending x z(leverage of its pre-RoPE key) + z(non-causal chunked attention it receives x its value norm, pooled)

where z is the z-score over the layer's scores (all its KV heads), the leverage is policies/leverage.py's (the same
seeded sketch) and the attention term policies/non_causal.py's, its chunks starting after the first sinks.
`blending` defaults to the share of the prompt evicted (1 - budget), as kvpress sets it to the compression ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView, asked_tokens
from evalkit.policies.leverage import Rotary, check_sketch, leverage, sketch_matrix, z_scored
from evalkit.policies.non_causal import ChunkAttention, by_value


@dataclass(kw_only=True)
class Compactor(Rotary, KVPolicy):
    """Per KV head: both ends' sinks, then the blend of leverage and non-causal attention."""

    name: str = "compactor"
    sink_start: int = 8
    sink_end: int = 4
    chunk: int = 256
    sketch: int = 48
    jitter: float = 0.01
    seed: int = 0
    blending: float | None = None  # None: the share evicted, 1 - asked / seen
    decode: bool = False

    chunkable: ClassVar[bool] = False  # leverage and chunks over the whole prompt
    decodable: ClassVar[bool] = False  # a prefill method (kvpress's CompactorPress)

    def needs(self) -> tuple[ChunkAttention]:
        return (ChunkAttention(self.chunk, (self.sink_start, self.sink_end)),)

    def prepare(self, model, probes) -> dict | None:
        self.read_rope(model)
        return None

    def protected(self, view: LayerView, k: int) -> Tensor:
        return (view.positions < self.sink_start) | (view.positions >= view.seen - self.sink_end)

    def min_tokens(self) -> int:
        return self.sink_start + self.sink_end + 1

    def score(self, view: LayerView) -> Tensor:
        t = view.keys.shape[2]
        lo, hi = self.sink_start, t - self.sink_end  # the prompt's tokens in order (a prefill method)
        keys = self.pre_rope_keys(view, lo, hi)
        b, h, _, d = keys.shape
        lev = leverage(keys, sketch_matrix((b, h, d, self.sketch), self.seed + view.layer_idx, keys), self.jitter)
        received = view.observed(ChunkAttention(self.chunk, (self.sink_start, self.sink_end)))
        attn = by_value(received, view.values[:, :, lo:hi])
        asked = min(view.seen, asked_tokens(self.budget, view.seen))
        blending = 1 - asked / view.seen if self.blending is None else self.blending
        middle = blending * z_scored(lev) + z_scored(attn)
        return F.pad(middle, (lo, t - hi), value=float(middle.max()))  # the sinks: protected anyway

    def check_params(self) -> None:
        check_sketch(self.sketch, self.jitter)
        if self.sink_start < 0 or self.sink_end < 0:
            raise ParamError(
                {"sink_start": self.sink_start, "sink_end": self.sink_end}, ": give sink counts >= 0 (8, 4)"
            )
        if self.chunk < 1:
            raise ParamError({"chunk": self.chunk}, ": give the tokens of a chunk, such as 256")
        if self.blending is not None and self.blending < 0:
            raise ParamError({"blending": self.blending}, ": give a weight >= 0 for the leverage term, or null")
