"""CriticalKV: any scorer's choice in two stages, the second weighted by what each value adds to the layer's output.

Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
(arXiv:2502.03805), as kvpress's CriticalKVPress applies it. A share `first_stage` of the k tokens a head keeps goes
to the inner policy's best scores (its protected tokens first); the rest to the best of the inner score, plus
`epsilon`, times the L1 norm of the value projected through the output projection, ||W_o,h v||_1, averaged over the
query heads h of the KV group: a token whose value barely moves the output is worth less than its attention says.
The output projections are read from the model once it is loaded (`prepare`).

CriticalAdaKV (the two stages within Ada-KV's head-adaptive budgets) is policies/critical_ada.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, Probes, Wrapper, checked_scores, kept_protected


def output_norms(values: Tensor, w_o: Tensor, n_heads: int) -> Tensor:
    """(B, Hkv, T): ||W_o,h v||_1 for each held value v, averaged over the query heads h of its KV group; w_o is the
    layer's output projection weight (hidden, Hq x D), as nn.Linear holds it."""
    b, hkv, t, d = values.shape
    per_head = w_o.t().reshape(n_heads, d, -1).to(values.dtype)  # (Hq, D, hidden)
    group = n_heads // hkv
    norms = torch.stack([(values[:, h // group] @ per_head[h]).abs().sum(dim=-1) for h in range(n_heads)], dim=1)
    return norms.view(b, hkv, group, t).mean(dim=2)


@dataclass(kw_only=True)
class CriticalKV(Wrapper):
    """The inner policy's top `first_stage` share, then its scores weighted by the values' output-projection norms."""

    name: str = "criticalkv"
    first_stage: float = 0.5
    epsilon: float = 1e-4

    def prepare(self, model, probes: Probes) -> dict | None:
        """Read each layer's output projection (the model's own weight, not a copy), and the query heads."""
        layers = model.get_decoder().layers
        self.w_o = {i: layer.self_attn.o_proj.weight.detach() for i, layer in enumerate(layers)}  # not a field
        self.n_heads = model.config.get_text_config().num_attention_heads
        return self.inner.prepare(model, probes)

    def select(self, view: LayerView, k: int) -> Tensor:
        if view.layer_idx not in getattr(self, "w_o", {}):
            raise ValueError(f"{self.name}: the output projections were not read (prepare() was not called)")
        scores = checked_scores(self.inner, self.inner.score(view), view)
        protected = kept_protected(self.inner, view, k)
        first = scores if protected is None else scores.masked_fill(protected, math.inf)
        weighted = (scores + self.epsilon) * output_norms(view.values.float(), self.w_o[view.layer_idx], self.n_heads)
        if protected is not None:
            weighted = weighted.masked_fill(protected, math.inf)
        n_first = int(k * self.first_stage)
        if n_first:
            weighted = weighted.scatter(-1, first.topk(n_first, dim=-1).indices, math.inf)
        return weighted.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values

    def check_params(self) -> None:
        super().check_params()
        if not 0.0 <= self.first_stage <= 1.0:
            raise ParamError({"first_stage": self.first_stage}, ": give the first stage's share in [0, 1]: 0.5")
        if self.epsilon < 0:
            raise ParamError({"epsilon": self.epsilon}, " is negative; give e.g. 0.0001")
