"""Merging: any scorer's choice, with each evicted value folded into its most similar kept token instead of dropped.

Merge-on-evict in the manner of Token Merging (Bolya et al., ICLR 2023, arXiv:2210.09461) and D2O (Wan et al. 2024,
arXiv:2406.13035), as kvpress's MergingPress applies it. The inner policy chooses the kept tokens; each evicted token
e finds, in its KV head, the kept token t whose key is the most cosine-similar (similarity s_e), and when s_e reaches
`similarity_threshold` (and, with `merge_fraction` < 1, is among that share of the head's highest) its value joins
t's with weight w_e = max(s_e, 0) x |v_e| / (|v_e| + |v_t| + 1e-6). A kept value that received any becomes
(v_t + sum w_e v_e) / (1 + sum w_e); the others, and every key, are unchanged. Every eviction merges: after the
prompt, each chunk of a chunked prefill and, with decode=true, while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, Wrapper, gather_tokens

EPS = 1e-6  # kvpress's: safe for float16 and bfloat16


def merged_values(keys: Tensor, values: Tensor, kept: Tensor, threshold: float, fraction: float) -> Tensor:
    """(B, Hkv, k, D) the values of the kept tokens `kept` (B, Hkv, k) of keys and values (B, Hkv, T, D), each
    evicted value folded into the kept token whose key is the most cosine-similar."""
    b, h, t, d = keys.shape
    k = kept.shape[-1]
    kept_v = gather_tokens(values, kept)
    if k in (0, t):
        return kept_v
    evicted = torch.ones(b, h, t, dtype=torch.bool, device=keys.device).scatter(-1, kept, False)
    evicted = evicted.nonzero()[:, 2].view(b, h, t - k)  # ascending, the same count in every head
    unit = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp(min=EPS)
    sim, target = (gather_tokens(unit, evicted) @ gather_tokens(unit, kept).transpose(-2, -1)).max(dim=-1)
    ok = sim >= threshold
    if fraction < 1.0 and bool(ok.any()):
        # the share `fraction` of the head's highest similarities among those that pass; the rest sink to -inf
        ok &= sim >= sim.masked_fill(~ok, float("-inf")).quantile(1.0 - fraction, dim=-1, keepdim=True)
    evicted_v = gather_tokens(values, evicted).float()
    evicted_norm = evicted_v.norm(dim=-1)
    target_norm = kept_v.float().norm(dim=-1).gather(-1, target)
    weights = sim.clamp(min=0) * ok * evicted_norm / (evicted_norm + target_norm + EPS)
    added = torch.zeros(b, h, k, d, device=keys.device).scatter_add(
        2, target[..., None].expand(-1, -1, -1, d), weights[..., None] * evicted_v
    )
    total = torch.zeros(b, h, k, device=keys.device).scatter_add(2, target, weights)
    merged = ((kept_v.float() + added) / (1.0 + total)[..., None]).to(values.dtype)
    return torch.where((total > 0)[..., None], merged, kept_v)


@dataclass(kw_only=True)
class Merging(Wrapper):
    """The inner policy's choice; evicted values merged into the most similar kept token's."""

    name: str = "merging"
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor]:
        values = merged_values(view.keys, view.values, kept, self.similarity_threshold, self.merge_fraction)
        return gather_tokens(view.keys, kept), values

    def check_params(self) -> None:
        super().check_params()
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ParamError(
                {"similarity_threshold": self.similarity_threshold}, ": give a cosine similarity in [0, 1]: 0.0"
            )
        if not 0.0 < self.merge_fraction <= 1.0:
            raise ParamError({"merge_fraction": self.merge_fraction}, ": give a share in (0, 1]: 1.0")
