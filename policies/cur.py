"""CurDKV: keep the tokens of highest leverage, estimated from the key and value norms, with no attention at all.

Sengupta et al. 2025, "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition" (arXiv:2509.15038).
CUR decomposition picks the rows of the key and value matrices with the highest leverage scores; the method
approximates a token's leverage by its squared norm, normalised within a local window of `window` tokens (the share
of the window's squared norm the token holds), once for its key and once for its value, and combines the two
(`combine`: their product by default, their mean, or one of them). The first `n_sink` tokens are kept first.

Departure: kvpress's CURPress can project the keys and values on a random Gaussian matrix first
(`use_random_leverage`); evalkit does not offer it (it would be drawn per layer from a seeded generator, as
policies/leverage.py draws its sketch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, SinkPolicy

COMBINE = ("product", "mean", "key", "value")


def local_share(x: Tensor, window: int) -> Tensor:
    """(B, H, T): each entry of x over the sum of its window of `window` entries (windows from the first token; the
    last may be shorter); window 0: x unchanged."""
    if window <= 0:
        return x
    b, h, t = x.shape
    padded = F.pad(x, (0, -t % window)).reshape(b, h, -1, window)
    return (padded / padded.sum(dim=-1, keepdim=True)).reshape(b, h, -1)[..., :t]


@dataclass(kw_only=True)
class CUR(SinkPolicy):
    """Per KV head: the sinks, then the highest approximate leverage of key and value (squared norm, local share)."""

    name: str = "cur"
    combine: str = "product"
    window: int = 16  # tokens of the local normalisation; 0: none
    decode: bool = False

    chunkable: ClassVar[bool] = False  # its windows are the prompt's, from the first token
    decodable: ClassVar[bool] = False  # a prefill method (kvpress's CURPress scores the prompt)

    def score(self, view: LayerView) -> Tensor:
        k2 = local_share(view.keys.float().square().sum(dim=-1), self.window)
        v2 = local_share(view.values.float().square().sum(dim=-1), self.window)
        return {"product": k2 * v2, "mean": (k2 + v2) / 2, "key": k2, "value": v2}[self.combine]

    def check_params(self) -> None:
        super().check_params()
        if self.combine not in COMBINE:
            raise ParamError({"combine": self.combine}, f" is not one of {', '.join(COMBINE)}")
        if self.window < 0:
            raise ParamError({"window": self.window}, " is negative; give tokens per window such as 16 (0: none)")
