"""CriticalAdaKV: CriticalKV's two stages within Ada-KV's head-adaptive budgets.

Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
(arXiv:2502.03805), its Ada-KV variant, as kvpress's CriticalAdaKVPress applies it. The layer's k x Hkv slots are
shared out among its KV heads as `adakv` shares them (the inner scores' top k x Hkv across the heads, each head first
keeping its `int(alpha x k)` best); then each head fills its own share b_h as `criticalkv` fills k: `int(b_h x
first_stage)` tokens by the inner scores (the floor and the protected tokens first), the rest by (inner score +
epsilon) x the values' output-projection norms. Heads keep different counts: the layer is stored ragged, as adakv's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.errors import ConfigError
from evalkit.policies import LayerView, padded_indices
from evalkit.policies.adakv import AdaKV, shared_out
from evalkit.policies.critical import CriticalKV, output_norms


@dataclass(kw_only=True)
class CriticalAdaKV(CriticalKV):
    """Ada-KV's budget per head, filled in CriticalKV's two stages."""

    name: str = "criticaladakv"
    alpha: float = 0.2  # each head's floor, a fraction of the uniform per-head budget (kvpress: alpha_safeguard)
    decode: bool = False  # as published: compress the prompt once
    decodable: ClassVar[bool] = False
    chunkable: ClassVar[bool] = False
    ragged: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False  # its choice is its selection, not a score a wrapper could use

    over = AdaKV.over  # the layer's k x Hkv over its heads

    def select(self, view: LayerView, k: int) -> Tensor:
        """(B, Hkv, kmax) ascending indices each head keeps, padded with -1 after its last."""
        if view.layer_idx not in getattr(self, "w_o", {}):
            raise ValueError(f"{self.name}: the output projections were not read (prepare() was not called)")
        scores, shares = shared_out(self, view, k)  # floor and protected tokens at +inf
        budgets = shares.sum(dim=-1)  # (B, Hkv) each head's share b_h
        norms = output_norms(view.values.float(), self.w_o[view.layer_idx], self.n_heads)
        weighted = ((scores + self.epsilon) * norms).masked_fill(scores == math.inf, math.inf)
        order = scores.argsort(dim=-1, descending=True, stable=True)  # the first stage: each head's best b_h x share
        first = torch.arange(scores.shape[-1], device=scores.device) < (budgets * self.first_stage).long()[..., None]
        weighted = weighted.scatter(-1, order, weighted.gather(-1, order).masked_fill(first, math.inf))
        if view.valid is not None:
            weighted = weighted.masked_fill(~view.valid, -math.inf)
        ranked = torch.arange(scores.shape[-1], device=scores.device) < budgets[..., None]  # each head's best b_h
        kept = torch.zeros_like(shares).scatter(-1, weighted.argsort(dim=-1, descending=True, stable=True), ranked)
        return padded_indices(kept)

    def check_params(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"policy.alpha={self.alpha}: the per-head floor is a fraction in [0, 1], e.g. 0.2")
        super().check_params()
