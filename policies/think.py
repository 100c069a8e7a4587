"""ThinK: key channels pruned per KV head, not tokens; over any token policy (ThinK + SnapKV) or the full cache.

Xu et al. 2025, "ThinK: Thinner Key Cache by Query-Driven Pruning" (ICLR 2025, arXiv:2407.21018), as kvpress's
ThinKPress applies it, alone or after a token press (ComposedPress([SnapKVPress, ThinKPress])). Once the inner policy
has chosen the tokens, each KV head scores its key channels by the mean square of the last `window` queries of the
context (averaged over the query heads of its group) times the mean square of its kept keys, and zeroes the
`int(D x channels)` lowest. The attention of a later query reads only the channels left, so a deployment stores
those: the bytes evalkit reports for a layer count, per head, only the key channels that are not zero in every
token held (evalkit.kv.cache.fp16_layer_bytes), plus the values in full. Channels are pruned once, after the prompt;
the keys of the question and of generated tokens keep every channel, as in kvpress.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evalkit.attention.observation import Observation, Window, WindowQueries
from evalkit.errors import ParamError
from evalkit.policies import LayerView, OnceWrapper, gather_tokens


def pruned_channels(keys: Tensor, queries: Tensor, n: int) -> Tensor:
    """(B, Hkv, n) the key channels each KV head prunes: the n lowest of mean_q(q^2) x mean_t(k^2), the query term
    averaged over the heads of the group. keys (B, Hkv, T, D), queries (B, Hq, W, D)."""
    b, hkv, _, d = keys.shape
    q = queries.float().pow(2).mean(dim=2).view(b, hkv, -1, d).mean(dim=2)  # (B, Hkv, D)
    return (q * keys.float().pow(2).mean(dim=2)).topk(n, dim=-1, largest=False).indices


@dataclass(kw_only=True)
class ThinK(OnceWrapper):
    """The inner policy's tokens; then `channels` of each KV head's key channels zeroed, the least queried."""

    name: str = "think"
    channels: float = 0.5  # the share of key channels pruned (kvpress key_channel_compression_ratio)
    window: int = 32  # the last context queries that score the channels

    def needs(self) -> tuple[Observation, ...]:
        return (*self.inner.needs(), WindowQueries(self.window))  # one recording where the inner's is the same

    def observation_window(self) -> int:
        return max(self.inner.observation_window(), self.window)

    def compresses(self) -> bool:
        return self.channels > 0 or self.inner.compresses()  # pruned key channels are a smaller cache too

    def over(self, view: LayerView, k: int) -> bool:
        return True  # the channels are pruned even where the inner policy keeps every token

    def select(self, view: LayerView, k: int) -> Tensor:
        if self.inner.over(view, k):
            return self.inner.select(view, k)
        b, h, t = view.keys.shape[:3]
        return torch.arange(t, device=view.keys.device).expand(b, h, t)

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor]:
        keys = gather_tokens(view.keys, kept)
        n = int(keys.shape[-1] * self.channels)
        if n:
            held: Window = view.observed(WindowQueries(self.window))
            pruned = pruned_channels(keys, held.queries[:, :, -self.window :], n)
            keys = keys.scatter(-1, pruned[:, :, None, :].expand(-1, -1, keys.shape[2], -1), 0.0)
        return keys, gather_tokens(view.values, kept)

    def check_params(self) -> None:
        super().check_params()
        if not 0.0 <= self.channels < 1.0:
            raise ParamError({"channels": self.channels}, ": give the share of key channels pruned in [0, 1): 0.5")
        if self.window < 1:
            raise ParamError({"window": self.window}, ": the channels are scored by at least 1 query; give 32")
