"""StreamingLLM: attention sinks plus a recent window.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks" (arXiv:2309.17453). The first
`n_sink` tokens soak up attention mass and are always kept; the rest of the budget is the most recent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from evalkit.policies import LayerView, SinkPolicy


@dataclass(kw_only=True)
class StreamingLLM(SinkPolicy):
    """Keep the `n_sink` first tokens and the most recent ones; evict the middle."""

    name: str = "streaming_llm"

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()  # the more recent, the higher
