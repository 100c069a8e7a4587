"""KeyDiff: keep the keys least similar to the others, with no attention scores.

Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv:2504.15364). Distinctive keys tend to receive high attention, so each KV
head keeps the keys of lowest cosine similarity to its anchor: the mean of the unit-normalised keys it holds,
mu = (1/n) sum_i k_i / |k_i| (score s_i = -cos(k_i, mu)), the relaxation of keeping the set of least pairwise cosine
similarity. As in kvpress's KeyDiffPress, on the post-RoPE keys as held. The paper evicts whenever the cache
exceeds its budget: block by block through the prompt (evalkit's `prefill=chunked`) and while generating.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class KeyDiff(KVPolicy):
    """Keep, per KV head, the keys least similar (cosine) to the mean of the head's unit keys."""

    name: str = "keydiff"

    def score(self, view: LayerView) -> Tensor:
        keys = view.keys.float()
        anchor = F.normalize(keys, dim=-1).mean(dim=2, keepdim=True)  # (B, Hkv, 1, D): mean of the unit keys
        return -F.cosine_similarity(keys, anchor, dim=-1)  # (B, Hkv, T): the less similar, the higher
