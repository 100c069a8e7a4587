"""Sliding window: keep the most recent tokens, with no attention sinks.

The control for StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
arXiv:2309.17453): the paper's "window attention" baseline, which caches only the most recent tokens and, the paper
shows, collapses once the first tokens (the attention sinks) leave the cache. Set beside `streaming_llm` at the same
budget, it measures what the sinks buy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class SlidingWindow(KVPolicy):
    """Keep the most recent tokens of every KV head; evict the oldest."""

    name: str = "window"

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()  # the more recent, the higher
