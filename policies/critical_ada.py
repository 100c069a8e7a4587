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

from torch import Tensor

from evalkit.policies import LayerView, best_per_head, padded_indices
from evalkit.policies.adakv import AdaKV, check_alpha, shared_out
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
        first = best_per_head(scores, (budgets * self.first_stage).long())  # the first stage: b_h x first_stage
        weighted = ((scores + self.epsilon) * norms).masked_fill(first | (scores == math.inf), math.inf)
        if view.valid is not None:
            weighted = weighted.masked_fill(~view.valid, -math.inf)
        return padded_indices(best_per_head(weighted, budgets))

    def check_params(self) -> None:
        check_alpha(self.alpha)
        super().check_params()
