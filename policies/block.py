"""Block-wise compression of the prompt: the inner scorer chooses among the tokens kept so far and the next block.

The prompt processing of KeyDiff (Park et al. 2025, arXiv:2504.15364), as kvpress's BlockPress simulates it: after the
prefill, each KV head starts from the first k tokens; then, block after block of `block` tokens, the inner policy
scores the tokens it keeps together with the block's and keeps its k best, so a token is compared only with the
survivors of the blocks before it. The keys and values are those of the one-shot prefill (every token attended to
the whole prompt); `prefill=chunked` is the true block-wise prefill, where later tokens are computed over the
compressed cache.

Only a scorer that reads nothing but the held keys, values and positions can be wrapped (knorm, keydiff, lagkv,
cur, streaming_llm, ...): a policy that needs attention observed (snapkv's window queries, h2o's mass) has them for
the whole prompt, not for each block, and is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.errors import ConfigError, ParamError
from evalkit.policies import LayerView, Wrapper, gather_tokens


def part(view: LayerView, idx: Tensor) -> LayerView:
    """The view of the tokens at `idx` (B, Hkv, n) of each head, in that order."""
    return dataclasses.replace(
        view,
        keys=gather_tokens(view.keys, idx),
        values=gather_tokens(view.values, idx),
        positions=gather_tokens(view.positions, idx),
        state={obs: gather_tokens(v, idx) for obs, v in view.state.items()},
        valid=None if view.valid is None else gather_tokens(view.valid, idx),
    )


@dataclass(kw_only=True)
class Block(Wrapper):
    """Keep k per KV head by passing over the prompt block by block, the inner policy choosing each time."""

    name: str = "block"
    block: int = 128

    chunkable: ClassVar[bool] = False  # it is itself a pass over the prompt's blocks
    decodable: ClassVar[bool] = False  # a prompt method: compress once

    def select(self, view: LayerView, k: int) -> Tensor:
        b, h, t = view.keys.shape[:3]
        kept = torch.arange(min(k, t), device=view.keys.device).expand(b, h, -1)
        for start in range(k, t, self.block):
            new = torch.arange(start, min(start + self.block, t), device=view.keys.device).expand(b, h, -1)
            candidates = torch.cat([kept, new], dim=-1)
            kept = candidates.gather(-1, self.inner.select(part(view, candidates), k))
        return kept.sort(dim=-1).values

    def check_params(self) -> None:
        super().check_params()
        check_part(self, "block", self.block, 128, "; or use prefill=chunked for a true block-wise prefill")


def check_part(wrapper: Wrapper, unit: str, size: int, example: int, more: str = "") -> None:
    """ConfigError for a part of fewer than one token, or an inner policy that needs attention observed over the
    whole prompt (a wrapper that scores the prompt part by part shows it only each part's keys and values)."""
    if size < 1:
        raise ParamError({unit: size}, f": give the tokens of a {unit}, such as {example}")
    if wrapper.inner.needs():
        raise ConfigError(
            f"{wrapper.name}: {wrapper.inner.name} needs attention observed over the whole prompt, not per {unit}; "
            f"wrap a scorer of keys and values (knorm, keydiff, lagkv, cur){more}"
        )
