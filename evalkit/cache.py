"""Caches that hold a chosen subset of tokens, built on transformers' public cache-layer classes.

Invariant (DESIGN.md section 4.2): a compacted layer reports the tokens *seen* from `get_seq_length()`, so
transformers gives every new token its true absolute (RoPE) position, while `get_mask_sizes()` reports the
tokens *held*, with an offset that keeps the causal mask right for several new tokens at once.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from evalkit.policies import PER_TOKEN, KVPolicy, LayerView, gather_tokens


class EvictingLayer(DynamicLayer):
    """A full-attention layer that holds, per KV head, a subset of the tokens it has seen."""

    is_croppable = False

    def __init__(
        self,
        keys: Tensor,
        values: Tensor,
        seen: int,
        state: dict[str, Tensor] | None = None,
        observations: dict[str, Tensor] | None = None,
    ):
        super().__init__()
        b, h, t, _ = keys.shape
        self.keys, self.values = keys, values  # (B, Hkv, T_held, D)
        self.positions = torch.arange(seen - t, seen, device=keys.device).expand(b, h, t)  # (B, Hkv, T_held)
        self.state = dict(state or {})  # per held token (B, Hkv, T_held), gathered along with the keys
        self.observations = observations or {}  # per layer, from the prefill
        self.seen = seen
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.advance(key_states.shape[2])
        return super().update(key_states, value_states)

    def advance(self, q: int) -> None:
        """Account for q new tokens: their absolute positions, zero per-token state, the tokens seen."""
        b, h = self.positions.shape[:2]
        new = torch.arange(self.seen, self.seen + q, device=self.positions.device).expand(b, h, q)
        self.positions = torch.cat([self.positions, new], dim=-1)
        self.state = {k: torch.cat([v, v.new_zeros(b, h, q)], dim=-1) for k, v in self.state.items()}
        self.seen += q

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.held
        # Held keys get mask indices seen-held .. seen-1: all before the new queries, which stay causal among
        # themselves. With offset 0 a multi-token query would see its own future.
        return held + query_length, self.seen - held

    @property
    def held(self) -> int:
        return self.keys.shape[-2]

    def keep(self, idx: Tensor) -> None:
        """Keep only the tokens at per-head indices idx (B, Hkv, k)."""
        self.keys = gather_tokens(self.keys, idx)
        self.values = gather_tokens(self.values, idx)
        self.positions = gather_tokens(self.positions, idx)
        self.state = {k: gather_tokens(v, idx) for k, v in self.state.items()}

    def view(self, layer_idx: int, n_layers: int) -> LayerView:
        return LayerView(
            layer_idx, n_layers, self.seen, self.keys, self.values, self.positions, self.state, self.observations
        )


def share(cache: Cache) -> Cache:
    """A cache over the same tensors. Layers grow by concatenation, so the original is never modified."""
    return Cache(layers=[copy.copy(layer) for layer in cache.layers])


def full_attention_layers(cache: Cache) -> list[int]:
    """Indices of the layers a policy may evict from; sliding-window layers bound themselves."""
    return [i for i, layer in enumerate(cache.layers) if not getattr(layer, "is_sliding", False)]


def compress(cache: Cache, policy: KVPolicy, observations: dict[int, dict[str, Tensor]] | None = None) -> Cache:
    """A new cache holding what `policy` keeps of the prefilled full `cache`; `cache` itself is unchanged.

    `observations` maps a layer index to what the prefill recorded there (see evalkit.attention).
    """
    layers = [copy.copy(layer) for layer in cache.layers]
    for layer_idx in full_attention_layers(cache):
        full, obs = cache.layers[layer_idx], (observations or {}).get(layer_idx, {})
        state = {k: v for k, v in obs.items() if k in PER_TOKEN and k in policy.needs}
        rest = {k: v for k, v in obs.items() if k not in PER_TOKEN}
        layers[layer_idx] = EvictingLayer(full.keys, full.values, full.get_seq_length(), state, rest)
    compressed = Cache(layers=layers)
    enforce(compressed, policy)
    return compressed


def enforce(cache: Cache, policy: KVPolicy) -> None:
    """Evict until every evictable layer holds exactly the policy's target for the tokens seen."""
    evictable = [i for i, layer in enumerate(cache.layers) if isinstance(layer, EvictingLayer)]
    n_layers = len(cache.layers)
    # Layer-dependent budgets (PyramidKV) are spread over the layers that evict: on hybrid models the sliding-window
    # layers keep their own bound and take no share.
    budgets = policy.keep_per_layer(cache.layers[evictable[0]].seen, len(evictable))
    targets = dict(zip(evictable, budgets, strict=True))
    for layer_idx in evictable:
        layer = cache.layers[layer_idx]
        if layer.held > targets[layer_idx]:
            layer.keep(policy.select(layer.view(layer_idx, n_layers), targets[layer_idx]))


def kv_bytes(cache: Cache) -> int:
    """Bytes of the tensors actually held (keys and values; packed codes, scales and minima), over all layers."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


DEPLOYED_ELEMENT_BYTES = 2  # fp16 or bf16: what a GPU deployment holds dense keys and values in


def deployed_bytes(cache: Cache) -> int:
    """Bytes the cache would hold in a deployment: dense layers in fp16/bf16 whatever dtype this machine computes
    in (float32 on the CPU), quantized layers as packed (their codes, fp16 scales and residual window)."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += (layer.keys.numel() + layer.values.numel()) * DEPLOYED_ELEMENT_BYTES
    return total


def fp16_bytes(cache: Cache) -> int:
    """Bytes the held tokens would take as fp16 keys and values: the reference for quantized storage."""
    return sum(
        2 * 2 * held * layer.keys.shape[1] * layer.keys.shape[-1]
        for held, layer in zip(held_per_layer(cache), cache.layers, strict=True)
    )


def held_per_layer(cache: Cache) -> list[int]:
    """Tokens each layer holds per KV head (the same for every head of a layer)."""
    return [
        layer.held if isinstance(layer, EvictingLayer) else (layer.keys.shape[-2] if layer.keys is not None else 0)
        for layer in cache.layers
    ]


def held_positions(layer) -> Tensor:
    """(B, Hkv, T_held) absolute positions a layer holds; plain layers hold their most recent tokens."""
    if isinstance(layer, EvictingLayer):
        return layer.positions
    b, h, t, _ = layer.keys.shape
    seen = layer.get_seq_length()
    return torch.arange(seen - t, seen, device=layer.keys.device).expand(b, h, t)


def retained_fraction(cache: Cache, positions: list[int]) -> list[float]:
    """Per layer, the fraction of the given absolute positions still held, averaged over KV heads."""
    out = []
    for layer in cache.layers:
        wanted = torch.tensor(positions, device=layer.keys.device)
        hit = torch.isin(held_positions(layer), wanted).sum(-1).float() / max(len(positions), 1)  # (B, Hkv)
        out.append(round(hit.mean().item(), 4))
    return out
