"""PyramidKV: SnapKV scores with per-layer budgets that shrink with depth.

Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069). Lower layers spread attention widely and get more tokens; upper layers focus and get fewer.
Budgets follow the reference code's formula (Zefan-Cai/KVCache-Factory `pyramidkv_utils.py`, which kvpress's
PyramidKVPress follows): for a uniform budget of k tokens, linear in depth from 2k - k/beta down to k/beta, the top
capped at the prompt less the window; where that leaves a layer fewer tokens than the observation window, every
layer falls back to SnapKV's uniform k. Only the layers that evict count: on hybrid models the sliding-window layers
keep their own bound and get no share of the pyramid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from evalkit.errors import ParamError
from evalkit.policies.snapkv import SnapKV


def pyramid(k: int, n_layers: int, beta: float, window: int, seen: int) -> list[int]:
    """Per-layer budgets (tokens held, window included) for a uniform budget of k, as the reference computes them."""
    low = k / beta
    high = 2 * k - low
    if high >= seen - window:
        high = seen - window
        low = 2 * k - high
    if n_layers < 2 or not seen >= high >= low >= window:
        return [k] * n_layers  # the reference's fallback: SnapKV's uniform budget
    step = (high - low) / (n_layers - 1)
    return [round(high - i * step) for i in range(n_layers)]


@dataclass(kw_only=True)
class PyramidKV(SnapKV):
    """SnapKV selection under a pyramid of per-layer budgets (`beta` sets how steep)."""

    name: str = "pyramidkv"
    beta: float = 20.0
    # Re-apportioning the pyramid as tokens arrive would have to grow layers that already evicted; the per-layer
    # budgets are not defined chunk by chunk either.
    decodable: ClassVar[bool] = False
    chunkable: ClassVar[bool] = False

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        return pyramid(self.target(seen), n_layers, self.beta, self.window, seen)

    def check_params(self) -> None:
        if self.beta < 1:
            raise ParamError({"beta": self.beta}, " must be >= 1 (1 = uniform budgets, larger = steeper)")
        super().check_params()
