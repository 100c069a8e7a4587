"""SimLayerKV: layers whose last queries look only at the first and the most recent tokens keep only those.

Zhang et al. 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction" (arXiv:2410.13846), as
kvpress's SimLayerKVPress runs it at the end of the prompt. A layer is *lazy* when the attention of its last `n_last`
context queries (softmax over every key, causal within those queries; the mean over the queries and all query heads)
puts more than `lazy_threshold` of its mass on the first `n_initial` keys and the `n_recent` keys before those
queries. A lazy layer keeps the first `n_initial` and the last `n_recent - n_last` tokens (StreamingLLM's shape); any
other layer keeps every token. So the memory saved follows from the threshold and the prompt, not from a budget:
`budget` stays 1.0 (every layer may keep everything) and the records show what each layer held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.attention.observation import WindowQueries
from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView, no_budget
from evalkit.policies.snapkv import window_attention


@dataclass(kw_only=True)
class SimLayerKV(KVPolicy):
    """Per layer: everything, or (when lazy) the first `n_initial` and last `n_recent - n_last` tokens."""

    name: str = "simlayerkv"
    lazy_threshold: float = 0.9  # the paper's and kvpress's value for Llama 3 (Llama 2: 0.65, Mistral: 0.8)
    n_last: int = 1  # kvpress's default, after the reference code's decoding mode
    n_recent: int = 1024
    n_initial: int = 4
    decode: bool = False
    # The layers are judged once, on the prompt's last queries, as kvpress's press and the paper's prefill judge them.
    decodable: ClassVar[bool] = False
    chunkable: ClassVar[bool] = False
    wrappable: ClassVar[bool] = False  # it chooses layers, not tokens by score

    def needs(self) -> tuple[WindowQueries]:
        return (WindowQueries(self.n_last),)

    def observation_window(self) -> int:
        return self.n_last

    def laziness(self, view: LayerView) -> float:
        """The share of the last `n_last` queries' attention on the first `n_initial` keys and the `n_recent` keys
        before those queries, averaged over the queries and the layer's query heads."""
        attn = window_attention(view, self.n_last)  # (B, Hkv, T): summed over the queries and each group's heads
        n_heads = view.observed(WindowQueries(self.n_last)).queries.shape[1]
        per_key = attn.sum(dim=1).mean(dim=0)[: -self.n_last] / (n_heads * self.n_last)  # the keys before the queries
        return float(per_key[: self.n_initial].sum() + per_key[-self.n_recent :].sum())

    def compresses(self) -> bool:
        return True  # its lazy layers keep a window whatever its budget (1.0)

    def over(self, view: LayerView, k: int) -> bool:
        t = view.keys.shape[2]
        return t > self.n_initial + self.n_recent + self.n_last and self.laziness(view) > self.lazy_threshold

    def select(self, view: LayerView, k: int) -> Tensor:
        b, h, t = view.keys.shape[:3]
        keep = torch.cat([torch.arange(self.n_initial), torch.arange(t - self.n_recent + self.n_last, t)])
        return keep.to(view.keys.device).expand(b, h, -1).clone()

    def check_params(self) -> None:
        no_budget(
            self.budget,
            "SimLayerKV keeps every token of a layer, or (a lazy layer) the first n_initial and last n_recent; set "
            "what it saves with $lazy_threshold (lower: more lazy layers) and $n_recent",
        )
        if not 0.0 <= self.lazy_threshold <= 1.0:
            raise ParamError({"lazy_threshold": self.lazy_threshold}, ": a share of attention in [0, 1], e.g. 0.9")
        if self.n_last < 1 or self.n_initial < 0 or self.n_recent <= self.n_last:
            raise ParamError(
                {"n_last": self.n_last, "n_initial": self.n_initial, "n_recent": self.n_recent},
                ": give n_last >= 1, "
                "n_initial >= 0 and n_recent > n_last (a lazy layer keeps its last n_recent - n_last tokens)",
            )
