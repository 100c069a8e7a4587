"""KV-cache policies: each decides which cached tokens every KV head keeps.

The interface they implement (KVPolicy, LayerView, Wrapper) is the contract's (evalkit.contract), re-exported here so
that a policy imports what it builds on from one place; the helpers below are shared by several policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evalkit.contract import (
    KVPolicy,
    LayerView,
    OnceWrapper,
    Probe,
    Probes,
    Wrapper,
    asked_tokens,
    checked_scores,
    gather_tokens,
    held_tokens,
    kept_protected,
)
from evalkit.errors import ConfigError, ParamError


@dataclass(kw_only=True)
class SinkPolicy(KVPolicy):
    """A policy that always keeps the first `n_sink` tokens of the context, the attention sinks (StreamingLLM,
    Expected Attention, KVzip); its budget holds at least those and one more."""

    n_sink: int = 4

    def protected(self, view: LayerView, k: int) -> Tensor:
        return (view.positions >= 0) & (view.positions < self.n_sink)  # a ragged layer's padding is at -1

    def min_tokens(self) -> int:
        return self.n_sink + 1

    def check_params(self) -> None:
        if self.n_sink < 0:
            raise ParamError({"n_sink": self.n_sink}, " is negative; give a number of sink tokens such as 4 (or 0)")


def full_attention_only(model, name: str, instead: str) -> None:
    """A ConfigError unless every layer of `model` attends to the whole context: for a policy whose pass runs
    transformers' own attention over a cache that holds every token (KVgrad, KVCompose); `instead` names another."""
    config = model.config.get_text_config()
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        raise ConfigError(
            f"{name} needs every layer to attend to the whole context; {type(model).__name__} has sliding-window "
            f"layers: {instead}"
        )


def no_budget(budget: float | int, keeps: str) -> None:
    """For a policy whose settings, not a budget, decide what it keeps (SimLayerKV, DMS): a ConfigError unless `budget`
    is 1.0 (every head may keep every token); `keeps` says what it keeps and which setting to turn instead."""
    if budget != 1.0:
        raise ParamError({"budget": budget}, f": {keeps}, and leave $budget at 1.0")


def best_per_head(scores: Tensor, counts: Tensor) -> Tensor:
    """(B, Hkv, T) bool: True on each head's `counts` highest scores, `counts` (B, Hkv) or broadcastable to it (ties:
    the earlier token); the choice of a policy whose heads keep different counts."""
    ranked = (torch.arange(scores.shape[-1], device=scores.device) < counts[..., None]).expand(scores.shape)
    kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return kept.scatter(-1, scores.argsort(dim=-1, descending=True, stable=True), ranked)


def padded_indices(kept: Tensor) -> Tensor:
    """(B, Hkv, kmax) ascending indices of the True slots of `kept` (B, Hkv, T) in each head, padded with -1 after a
    head's last: what a ragged policy's `select` returns when heads keep different counts."""
    t = kept.shape[-1]
    order = torch.where(kept, torch.arange(t, device=kept.device), t).sort(dim=-1).values
    order = order[..., : int(kept.sum(-1).max())]
    return order.masked_fill(order == t, -1)


__all__ = [
    "KVPolicy",
    "LayerView",
    "OnceWrapper",
    "Probe",
    "Probes",
    "SinkPolicy",
    "Wrapper",
    "asked_tokens",
    "best_per_head",
    "checked_scores",
    "full_attention_only",
    "gather_tokens",
    "held_tokens",
    "kept_protected",
    "no_budget",
    "padded_indices",
]
