"""What a policy may look at for one attention layer (LayerView), the prompts it may learn from (Probe, Probes), and
the one gather of kept tokens every consumer of the contract shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from evalkit.attention.observation import Observation


@dataclass
class Probe:
    """A prompt a policy learns from while it prepares (KVPolicy.prepare): its ids, the positions of the evidence in
    it, and how many of its last tokens are the question."""

    ids: Tensor  # (1, N)
    evidence: list[int]
    question_tokens: int


class Probes(Protocol):
    """Prompts for a policy to learn from, built by the run pipeline with the model's tokenizer (evalkit.engine.probes):
    policies never build prompts or tasks themselves."""

    def needles(self, context: int, depths: list[float]) -> list[Probe]:
        """A synthetic needle in a `context`-token haystack at each depth (0 = start, 1 = end)."""
        ...


@dataclass
class LayerView:
    """What a policy may look at for one attention layer."""

    layer_idx: int
    n_layers: int
    seen: int  # tokens that have gone through the layer
    keys: Tensor  # (B, Hkv, T, D) post-RoPE keys as held
    values: Tensor  # (B, Hkv, T, D)
    positions: Tensor  # (B, Hkv, T) absolute position of each held token
    state: dict[Observation, Tensor] = field(default_factory=dict)  # per-token observations (B, Hkv, T)
    observations: dict[Observation, object] = field(default_factory=dict)  # per-layer observations
    valid: Tensor | None = None  # (B, Hkv, T) False on the padding slots of a ragged layer (positions -1); None: none

    def observed(self, obs: Observation):
        """The value of `obs` (one of the policy's `needs()`) at this layer, per held token or per layer."""
        if obs in self.state:
            return self.state[obs]
        if obs not in self.observations:
            raise ValueError(
                f"layer {self.layer_idx} holds no {obs}: the engine records what the policy's needs() returns, "
                "during the prefill (and a second pass) that the compressed cache came from"
            )
        return self.observations[obs]

    @property
    def real(self) -> Tensor:
        """(B, Hkv, T) True on the slots that hold a token (all of them unless the layer is ragged)."""
        return self.valid if self.valid is not None else torch.ones_like(self.positions, dtype=torch.bool)


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """Select tokens along dim 2 of (B, H, T, ...) with per-head indices (B, H, k)."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))
