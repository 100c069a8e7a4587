"""KV-cache policies: each decides which cached tokens every KV head keeps.

A policy scores tokens; the base class turns scores into kept indices once, for every policy. The engine
(`evalkit.cache`), not the policy, owns caches, gathers and positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from torch import Tensor

from evalkit.errors import ConfigError
from evalkit.hydra_errors import check_fields


class Need(str, Enum):
    """What a policy needs observed in attention, besides the keys and values it holds (evalkit.attention)."""

    ATTN_MASS = "attn_mass"  # per token: the attention it has received, summed over queries (H2O)
    WINDOW_QUERIES = "window_queries"  # per layer: the last `observation_window()` queries it has seen (SnapKV, TOVA)


# Needs carried per held token and gathered with the keys; the others are per layer.
PER_TOKEN = frozenset({Need.ATTN_MASS})


@dataclass
class LayerView:
    """What a policy may look at for one attention layer."""

    layer_idx: int
    n_layers: int
    seen: int  # tokens that have gone through the layer
    keys: Tensor  # (B, Hkv, T, D) post-RoPE keys as held
    values: Tensor  # (B, Hkv, T, D)
    positions: Tensor  # (B, Hkv, T) absolute position of each held token
    state: dict[str, Tensor] = field(default_factory=dict)  # per held token (B, Hkv, T), e.g. attn_mass
    observations: dict[str, Tensor] = field(default_factory=dict)  # per layer, e.g. window_queries (B, Hq, W, D)


@dataclass(kw_only=True)
class KVPolicy:
    """Base policy: keep the `target` highest-scoring tokens per KV head, protected tokens first.

    `budget` is a fraction of the tokens seen (0 < f <= 1, held = ceil(f * seen)) or an absolute number of
    tokens (an int). A fraction of 1.0 keeps every token, so any policy at 1.0 reproduces the full cache.
    """

    name: str
    budget: float | int = 1.0
    decode: bool = True  # also enforce the budget after every forward while decoding

    # What the engine and the config checks read; a new policy declares them and nothing else changes.
    needs: ClassVar[frozenset[Need]] = frozenset()  # observed in attention, beyond the held keys and values
    chunkable: ClassVar[bool] = True  # can evict chunk by chunk in a chunked prefill (prefill=chunked)
    decodable: ClassVar[bool] = True  # can keep its budget while decoding (decode=true)

    def observation_window(self) -> int:
        """Context queries the policy scores with (Need.WINDOW_QUERIES); 0 when it needs none."""
        return 0

    def score(self, view: LayerView) -> Tensor:
        """(B, Hkv, T) keep-priority of each held token; higher is kept first."""
        raise NotImplementedError

    def protected(self, view: LayerView, k: int) -> Tensor | None:
        """(B, Hkv, T) bool mask of tokens the policy promises to keep, whatever the scores, when keeping k."""
        return None

    def min_tokens(self) -> int:
        """Fewest tokens a budget may keep: the protected tokens plus one."""
        return 1

    def target(self, seen: int) -> int:
        """Tokens each head holds once `seen` tokens have gone through the layer; never fewer than the policy's
        protected tokens plus one (which matters early in a chunked prefill, when a fraction of few tokens is
        smaller than, say, SnapKV's window)."""
        return min(seen, max(self.asked(seen), self.min_tokens()))

    def asked(self, seen: int) -> int:
        """Tokens the budget itself names for `seen` tokens: ceil(f * seen), or the token count."""
        return math.ceil(self.budget * seen) if isinstance(self.budget, float) else self.budget

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        """Tokens held per layer; uniform here, layer-dependent policies override it."""
        return [self.target(seen)] * n_layers

    def select(self, view: LayerView, k: int) -> Tensor:
        """(B, Hkv, k) ascending indices of the tokens each KV head keeps."""
        scores = self.score(view).float()
        protected = self.protected(view, k)
        if protected is not None:
            if int(protected.sum(-1).max()) > k:
                raise ValueError(f"{self.name}: {int(protected.sum(-1).max())} protected tokens exceed the {k} kept")
            scores = scores.masked_fill(protected, math.inf)
        return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values

    def check_params(self) -> None:
        """Raise ConfigError for a parameter out of its range; the types are checked already (check_fields).
        Policies with parameters extend it."""

    def validate(self, shortest_context: int | None) -> None:
        """Raise ConfigError for a parameter of the wrong type or out of range, or a budget that cannot work on the
        shortest context of the run (None: unknown)."""
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ConfigError(f"policy.budget={b!r}: give a fraction in (0, 1] or a whole number of tokens")
        check_fields(self, "policy")  # every field against its annotation: bools are bools, ints whole numbers
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise ConfigError(
                f"policy.budget={b} is outside (0, 1] as a fraction of the context; "
                "give a fraction such as 0.25 or a whole number of tokens such as 512"
            )
        if isinstance(b, int) and b < 1:
            raise ConfigError(f"policy.budget={b} keeps no token; give a fraction such as 0.25 or tokens such as 512")
        if self.decode and not self.decodable:
            raise ConfigError(f"{self.name} compresses once, after the prompt: set policy.decode=false")
        self.check_params()
        if shortest_context is None:
            return
        kept = min(shortest_context, self.asked(shortest_context))
        if kept < min(self.min_tokens(), shortest_context):
            what = f"{b} tokens" if isinstance(b, int) else f"a fraction {b} of {shortest_context} tokens"
            raise ConfigError(
                f"policy.budget keeps {kept} tokens ({what}), fewer than the {self.min_tokens()} that "
                f"{self.name} needs (its protected tokens plus one); raise policy.budget"
            )


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """Select tokens along dim 2 of (B, H, T, ...) with per-head indices (B, H, k)."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


__all__ = ["PER_TOKEN", "KVPolicy", "LayerView", "Need", "gather_tokens"]
