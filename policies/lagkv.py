"""LagKV: score each token against the partition that follows it, with no attention at all.

Liang et al. 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"
(arXiv:2504.04704). After the `n_sink` attention sinks the context is cut into partitions of `lag_size` tokens. The
keys (and, separately, the values) of a partition are min-max normalised per channel by the range of the NEXT
partition (its lag reference); a token's score is the standard deviation of its normalised channels, softmaxed over
its partition, the key and value scores averaged. The tokens of each partition are then ranked within it (rank /
lag_size), so that every scored partition gives up the same share. The sinks and the last partition with the tokens
after it (which have no reference) are kept first. A context shorter than `n_sink + 2 lag_size` has no partition
with a reference: the sinks and then the most recent tokens are kept, a sliding window (kvpress's LagKVPress does
the same).

Departure: kvpress's experimental `cross_scoring` (the raw scores compared across partitions) is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView


def lag_scores(states: Tensor, lag: int) -> Tensor:
    """(B, H, P - 1, lag) the score of each token of the first P - 1 partitions of `states` (B, H, P, lag, D), by the
    range of the partition after it."""
    ref, scored = states[:, :, 1:], states[:, :, :-1]
    lo, hi = ref.amin(dim=-2, keepdim=True), ref.amax(dim=-2, keepdim=True)  # per channel, over the reference's tokens
    return ((scored - lo) / (hi - lo)).std(dim=-1).softmax(dim=-1)


@dataclass(kw_only=True)
class LagKV(KVPolicy):
    """Per KV head: sinks and the unreferenced tail first, then each partition's tokens by their lag-relative rank."""

    name: str = "lagkv"
    n_sink: int = 4
    lag_size: int = 128
    decode: bool = False

    chunkable: ClassVar[bool] = False  # the partitions are those of the whole prompt
    decodable: ClassVar[bool] = False  # scored once, after the prompt (as kvpress: a prefill press)

    def score(self, view: LayerView) -> Tensor:
        keys, values = view.keys.float(), view.values.float()
        b, h, t, d = keys.shape
        sink, lag = self.n_sink, self.lag_size
        if t < sink + 2 * lag:  # no partition has a reference: the sinks, then the newest tokens
            rest = max(0, t - sink)
            recent = torch.arange(rest, device=keys.device, dtype=torch.float32) / max(1, rest)
            return torch.cat([keys.new_ones(t - rest), recent]).expand(b, h, t)
        end = sink + (t - sink) // lag * lag  # the partitions end here; the tokens after are the tail
        parts = (end - sink) // lag

        def split(x: Tensor) -> Tensor:
            return x[:, :, sink:end].reshape(b, h, parts, lag, d)

        score = (lag_scores(split(keys), lag) + lag_scores(split(values), lag)) / 2
        rank = score.argsort(dim=-1).argsort(dim=-1).float() / lag  # in [0, 1): the rank within the partition
        tail = t - sink - rank.shape[2] * lag  # the last partition and what follows it
        return torch.cat([keys.new_ones(b, h, sink), rank.reshape(b, h, -1), keys.new_ones(b, h, tail)], dim=-1)

    def check_params(self) -> None:
        if self.n_sink < 0:
            raise ParamError({"n_sink": self.n_sink}, " is negative; give a number of sink tokens such as 4 (or 0)")
        if self.lag_size < 2:
            raise ParamError({"lag_size": self.lag_size}, ": a partition needs 2 tokens or more; e.g. 128")
