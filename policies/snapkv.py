"""SnapKV: keep the prefix tokens that the last context queries attend to, plus those queries' window.

Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv:2404.14469). Scores are
the attention of the last `window` queries on each key (softmax over every key, the window's own included), summed
over those queries and the query heads of the KV group. As in the paper's code (FasterDecoding/SnapKV,
`snapkv_utils.py`), only the prefix before the window is scored and smoothed by 1-D pooling (`kernel`, default 5,
avg or max, zero padding counted in the average); each KV head keeps its own top-k of the prefix, and the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from evalkit.attention.observation import Window, WindowQueries
from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView


def window_attention(view: LayerView, window: int) -> Tensor:
    """(B, Hkv, T) attention of the last `window` context queries on each held key, summed over the queries
    and the query heads that share the KV head. Memory O(window x T)."""
    held: Window = view.observed(WindowQueries(window))
    q = held.queries[:, :, -window:]  # (B, Hq, W, D), already scaled
    q_pos = held.positions[-window:]  # (W,) absolute positions of those queries
    b, hq, w, _ = q.shape
    hkv, t = view.keys.shape[1], view.keys.shape[2]
    group = hq // hkv
    keys = view.keys.float().repeat_interleave(group, dim=1)  # (B, Hq, T, D)
    scores = q @ keys.transpose(-1, -2)  # (B, Hq, W, T)
    # Each window query sees the keys at or before its own position; the padding of a ragged layer (position -1) none.
    k_pos = view.positions.repeat_interleave(group, dim=1)  # (B, Hq, T)
    hidden = (k_pos[:, :, None, :] > q_pos[None, None, :, None]) | (k_pos[:, :, None, :] < 0)
    scores = scores.masked_fill(hidden, float("-inf"))
    return scores.softmax(dim=-1).sum(dim=2).view(b, hkv, group, t).sum(dim=2)


@dataclass(kw_only=True)
class SnapKV(KVPolicy):
    """Top-k by pooled observation-window attention; the window itself is always kept."""

    name: str = "snapkv"
    window: int = 32
    kernel: int = 5
    pooling: str = "avg"
    decode: bool = False  # as published: compress the prompt once

    def needs(self) -> tuple[WindowQueries]:
        return (WindowQueries(self.window),)

    def observation_window(self) -> int:
        return self.window

    def score(self, view: LayerView) -> Tensor:
        scores = window_attention(view, self.window)  # (B, Hkv, T)
        b, h, t = scores.shape
        n = t - self.window  # the prefix: held tokens before the observation window (which is always kept)
        if n <= 0:
            return scores
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        pooled = pool(scores[..., :n].reshape(b * h, 1, n), self.kernel, stride=1, padding=self.kernel // 2)
        return torch.cat([pooled.reshape(b, h, n), scores[..., n:]], dim=-1)

    def protected(self, view: LayerView, k: int) -> Tensor:
        # At prefill end: the observation window. While decoding (decode=true), the most recent `window` tokens;
        # older tokens compete by their prefill-window scores, and tokens added after the prefill score zero.
        return view.positions >= view.seen - self.window

    def min_tokens(self) -> int:
        return self.window + 1

    def check_params(self) -> None:
        if self.window < 1:
            raise ParamError(
                {"window": self.window}, ": the observation window needs at least 1 query; give e.g. $window=32"
            )
        if self.pooling not in ("avg", "max"):
            raise ParamError({"pooling": self.pooling}, " is not one of ['avg', 'max']")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ParamError({"kernel": self.kernel}, " must be an odd number >= 1 (it centres on each token)")
