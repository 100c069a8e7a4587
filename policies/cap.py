"""CAPKV: keep the tokens whose values add the most capacity in the directions the queries are expected to look.

"CAPKV" (arXiv:2604.25975), as kvpress's CapPress computes it. Per query head, the anchor mu is the mean of the
context's pre-RoPE queries after the sinks, rotated by the RoPE rotation averaged over the next `n_future_positions`
positions (Expected Attention's statistics and rotation, policies/expected_attention.py). A token's relevance is
w_i = exp(tau x cos(mu, k_i)) (shifted by the head's largest before the exponential), its capacity matrix
A = I + sum_j (w_j + epsilon) v_j v_j^T over the tokens after the sinks, and its score w_i x v_i^T A^-1 v_i (the
weighted leverage of its value), averaged over the query heads of its KV group. The first `n_sink` tokens are kept
first. Like kvpress's press it scores the prompt once: the anchor is the prompt's queries.

As kvpress notes, it departs from the paper in three places evalkit follows: the anchor and the keys are L2-normalised
before their product, the value stands for the output direction u_i, and the anchor is rotated by the averaged RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, SinkPolicy
from evalkit.policies.expected_attention import QueryStats, Stats, averaged_rotation


@dataclass(kw_only=True)
class CAPKV(SinkPolicy):
    """Per KV head: the sinks, then the relevance-weighted leverage of the values."""

    name: str = "capkv"
    tau: float = 5.0  # sharpness of the relevance weights
    n_future_positions: int = 512
    epsilon: float = 1e-6  # added to each weight in the capacity matrix
    decode: bool = False

    chunkable: ClassVar[bool] = False  # the anchor is the whole prompt's queries
    decodable: ClassVar[bool] = False  # the future positions are those after the prompt

    def needs(self) -> tuple[QueryStats]:
        return (QueryStats(self.n_sink),)

    def score(self, view: LayerView) -> Tensor:
        stats: Stats = view.observed(QueryStats(self.n_sink))
        rot = averaged_rotation(stats.inv_freq, stats.scaling, view.seen, self.n_future_positions)
        anchor = F.normalize(stats.mean @ rot.T, dim=-1)  # (B, Hq, D)
        s = self.n_sink  # the prompt's tokens in order (a prefill method): the sinks first
        keys, values = view.keys[:, :, s:].float(), view.values[:, :, s:].float()
        b, hkv, t, d = keys.shape
        group = anchor.shape[1] // hkv
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)  # (B, Hq, T', D)
        cosine = torch.einsum("bhd,bhtd->bht", anchor, F.normalize(keys, dim=-1)).clamp(-1.0, 1.0)
        logits = self.tau * cosine
        weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # (B, Hq, T')
        scaled = values * (weights + self.epsilon).sqrt()[..., None]
        capacity = torch.eye(d, device=values.device) + scaled.transpose(-1, -2) @ scaled  # (B, Hq, D, D)
        solved = torch.linalg.solve(capacity, values.transpose(-1, -2))  # A^-1 v for every token, (B, Hq, D, T')
        scores = weights * (values.transpose(-1, -2) * solved).sum(dim=-2)
        scores = scores.view(b, hkv, group, t).mean(dim=2)
        return F.pad(scores, (s, 0), value=float(scores.max()) if t else 0.0)  # the sinks: protected anyway

    def check_params(self) -> None:
        super().check_params()
        if self.n_future_positions < 1:
            raise ParamError({"n_future_positions": self.n_future_positions}, ": give 1 or more, such as 512")
        if self.tau <= 0 or self.epsilon < 0:
            raise ParamError({"tau": self.tau, "epsilon": self.epsilon}, ": give tau > 0 and epsilon >= 0")
