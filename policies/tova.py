"""TOVA: keep the tokens the current query attends to most, averaged over the layer's heads.

Oren et al. 2024, "Transformers are Multi-State RNNs" (arXiv:2401.06104). Token Omission Via Attention: after every
forward, the attention of the newest query (softmax over every held key, its own included), averaged over all the
attention heads of the layer, ranks the held tokens; the layer keeps the top ones, the same tokens in every KV head,
and so drops the token attended least at each decode step. At the end of the prompt, the last context query's
attention decides which prompt tokens stay (the reference code, schwartz-lab-NLP/TOVA `tova_cache.py`, reduces the
prompt the same way). The newest token competes like any other, as in the reference code (kvpress's TOVAPress
always keeps it; its own attention weight is usually high).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evalkit.attention.observation import WindowQueries
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.snapkv import window_attention


@dataclass(kw_only=True)
class TOVA(KVPolicy):
    """Top-k by the last query's attention, averaged over every query head of the layer; one set per layer."""

    name: str = "tova"

    def needs(self) -> tuple[WindowQueries]:
        return (WindowQueries(1),)  # the current query only

    def observation_window(self) -> int:
        return 1  # the current query only

    def score(self, view: LayerView) -> Tensor:
        pos = view.positions
        if not torch.equal(pos, pos[:, :1].expand_as(pos)):
            raise ValueError(f"{self.name}: the KV heads of layer {view.layer_idx} hold different tokens")
        attn = window_attention(view, 1)  # (B, Hkv, T): the last query, summed over each group's query heads
        n_heads = view.observed(WindowQueries(1)).queries.shape[1]
        return (attn.sum(dim=1, keepdim=True) / n_heads).expand_as(attn)  # the mean over all heads of the layer
