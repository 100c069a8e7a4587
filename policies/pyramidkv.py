"""PyramidKV: SnapKV scores with per-layer budgets that shrink with depth.

Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(arXiv:2406.02069). Lower layers spread attention widely and get more tokens; upper layers focus and get fewer.
Budgets fall linearly from the first layer to the last, from 2k - k/beta to k/beta, and sum to the same total as
the uniform budget k per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalkit.errors import ConfigError
from evalkit.policies.snapkv import SnapKV


def pyramid(k: int, n_layers: int, beta: float, lo: int, hi: int) -> list[int]:
    """Per-layer budgets, linear in depth, each in [lo, hi], summing to exactly n_layers * k."""
    lo = min(lo, k)
    total = n_layers * k
    small = max(lo, round(k / beta))
    large = 2 * k - small
    step = (large - small) / max(n_layers - 1, 1)
    budgets = [min(hi, max(lo, round(large - i * step))) for i in range(n_layers)]
    # Rounding and clipping move the sum off by a little: give or take tokens, deepest layers last / first.
    i = 0
    while sum(budgets) != total:
        j = i % n_layers
        if sum(budgets) < total and budgets[j] < hi:
            budgets[j] += 1
        elif sum(budgets) > total and budgets[n_layers - 1 - j] > lo:
            budgets[n_layers - 1 - j] -= 1
        i += 1
    return budgets


@dataclass(kw_only=True)
class PyramidKV(SnapKV):
    """SnapKV selection under a pyramid of per-layer budgets (`beta` sets how steep)."""

    name: str = "pyramidkv"
    beta: float = 20.0

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        return pyramid(self.target(seen), n_layers, self.beta, lo=min(seen, self.min_tokens()), hi=seen)

    def check_params(self) -> None:
        if self.decode:
            # Re-apportioning the pyramid as tokens arrive would have to grow layers that already evicted.
            raise ConfigError("pyramidkv compresses once, after the prompt, as published: set policy.decode=false")
        if self.beta < 1:
            raise ConfigError(f"policy.beta={self.beta} must be >= 1 (1 = uniform budgets, larger = steeper)")
        super().check_params()
