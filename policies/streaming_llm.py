"""StreamingLLM: attention sinks plus a recent window.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks" (arXiv:2309.17453). The first
`n_sink` tokens soak up attention mass and are always kept; the rest of the budget is the most recent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class StreamingLLM(KVPolicy):
    """Keep the `n_sink` first tokens and the most recent ones; evict the middle."""

    name: str = "streaming_llm"
    n_sink: int = 4

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()  # the more recent, the higher

    def protected(self, view: LayerView, k: int) -> Tensor:
        return view.positions < self.n_sink

    def min_tokens(self) -> int:
        return self.n_sink + 1

    def check_params(self) -> None:
        if self.n_sink < 0:
            raise ConfigError(f"policy.n_sink={self.n_sink} is negative; give a number of sink tokens such as 4 (or 0)")
