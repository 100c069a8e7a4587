"""Random eviction: a control. A policy that does not beat it at the same budget is not using its scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class RandomKeep(KVPolicy):
    """Keep a uniformly random subset per KV head, reproducible for `seed` (per layer and per step)."""

    name: str = "random"
    seed: int = 0
    decode: bool = False

    def score(self, view: LayerView) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + view.layer_idx * 10_007 + view.seen)
        return torch.rand(view.positions.shape, generator=g).to(view.positions.device)
