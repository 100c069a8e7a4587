"""Key-norm eviction: a control that needs no attention at all.

Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (arXiv:2406.11430):
keys with a low L2 norm tend to receive high attention, so they are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class KNorm(KVPolicy):
    """Keep the keys of lowest L2 norm per KV head."""

    name: str = "knorm"
    decode: bool = False

    def score(self, view: LayerView) -> Tensor:
        return -view.keys.float().norm(dim=-1)
