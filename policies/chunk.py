"""Independent chunks: the prompt cut into chunks of `chunk` tokens, each compressed on its own by the inner scorer.

kvpress's ChunkPress (after FINCH, Corallo & Papotti 2024, which compresses a long prompt chunk by chunk): every
part of the context keeps its share of the budget, so no stretch of the prompt is emptied because another scores
higher. Each chunk keeps its share of the k tokens a KV head holds, in proportion to its length: floor(k x len / T),
and the tokens left over go one each to the chunks with the largest remainders (the first on a tie), so the shares
add up to k. The inner policy chooses within the chunk, seeing only the chunk's keys, values and positions; as for
`block`, a scorer that needs attention observed over the whole prompt (snapkv, h2o) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.policies import LayerView, Wrapper
from evalkit.policies.block import check_part, part


def shares(k: int, lengths: list[int]) -> list[int]:
    """k split over chunks of `lengths` tokens in proportion: floors, then one more for the largest remainders."""
    total = sum(lengths)
    exact = [k * n / total for n in lengths]
    out = [int(e) for e in exact]
    order = sorted(range(len(lengths)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: k - sum(out)]:
        out[i] += 1
    return out


@dataclass(kw_only=True)
class Chunk(Wrapper):
    """Each chunk of the prompt keeps its share of the budget, chosen by the inner policy within the chunk."""

    name: str = "chunk"
    chunk: int = 1024

    chunkable: ClassVar[bool] = False  # its chunks are the whole prompt's
    decodable: ClassVar[bool] = False  # a prompt method: compress once

    def select(self, view: LayerView, k: int) -> Tensor:
        b, h, t = view.keys.shape[:3]
        starts = list(range(0, t, self.chunk))
        lengths = [min(self.chunk, t - s) for s in starts]
        kept = []
        for start, n, k_c in zip(starts, lengths, shares(k, lengths), strict=True):
            if k_c == 0:
                continue
            idx = torch.arange(start, start + n, device=view.keys.device).expand(b, h, -1)
            kept.append(start + self.inner.select(part(view, idx), k_c))
        return torch.cat(kept, dim=-1)

    def check_params(self) -> None:
        super().check_params()
        check_part(self, "chunk", self.chunk, 1024)
