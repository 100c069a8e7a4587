"""Attention that policies can observe, registered through transformers' public AttentionInterface.

The registered function hands the output to transformers' own SDPA forward, so logits are those of plain SDPA,
and on the side records what policies need, computed from the post-RoPE queries and keys in query chunks so
that the extra memory stays bounded (no (T, T) attention matrix, no eager attention):

- `attn_mass` (H2O): for every key, the attention it received, summed over queries and over the query heads
  that share its KV head. During prefill it is returned per layer; after compression it accumulates into the
  `attn_mass` state of each evicting layer.
- `window_queries` (SnapKV, PyramidKV, TOVA): the last `window` queries of the context, scaled, per layer. After
  compression, every forward slides it on: each evicting layer then holds the last `window` queries it has seen
  (with a chunked prefill: the latest chunk's; while decoding: the newest), so a policy that evicts while decoding
  scores with the current queries.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "evalkit_sdpa"
CHUNK_ELEMENTS = 1 << 24  # score elements per query chunk: bounds the observation's extra memory (64 MiB fp32)
MAX_CHUNK = 64

_observer: contextvars.ContextVar = contextvars.ContextVar("evalkit_observer", default=None)


def causal_tail_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """(1, 1, q, k) bool: the q queries are the last q keys; each sees every earlier key and itself."""
    q_idx = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return (torch.arange(k_len, device=device)[None, :] <= q_idx)[None, None]


def attention_mass(query: Tensor, key: Tensor, scaling: float, chunk_elements: int = CHUNK_ELEMENTS) -> Tensor:
    """(B, Hkv, Tk) attention each key receives from the queries (the last Tq keys), summed over queries and
    over the query heads of its KV group. Chunked over queries: memory O(chunk x Tk), never O(Tq x Tk); each chunk
    multiplies only the keys it can see, so the masked upper triangle costs nothing."""
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    group, past = hq // hkv, tk - tq
    # Small chunks keep the scores in cache: 64 queries measured fastest on CPU at 2k and 8k tokens.
    chunk = max(1, min(MAX_CHUNK, chunk_elements // (b * hq * tk)))
    q = query.view(b, hkv, group, tq, d)  # the query heads of each KV group side by side
    keys_t = key.float().transpose(-1, -2)  # (B, Hkv, D, Tk)
    mass = torch.zeros(b, hkv, tk, dtype=torch.float32, device=key.device)
    for start in range(0, tq, chunk):
        end = min(start + chunk, tq)
        seen = past + end  # keys visible to the chunk's last query
        rows = (q[:, :, :, start:end].float() * scaling).reshape(b, hkv, group * (end - start), d)
        scores = rows @ keys_t[..., :seen]  # (B, Hkv, G*c, seen)
        visible = torch.arange(seen, device=key.device) <= past + torch.arange(start, end, device=key.device)[:, None]
        scores.masked_fill_(~visible.repeat(group, 1), float("-inf"))
        mass[..., :seen] += scores.softmax(dim=-1).sum(dim=2)
    return mass


@dataclass
class PrefillObserver:
    """Records, per full-attention layer, what the variants of one prefill need."""

    mass: bool = False
    window: int = 0
    observations: dict[int, dict[str, Tensor]] = field(default_factory=dict)

    def record(self, layer_idx: int, layer, query: Tensor, key: Tensor, scaling: float) -> None:
        if getattr(layer, "is_sliding", False):
            return
        obs = self.observations.setdefault(layer_idx, {})
        if self.mass:
            obs["attn_mass"] = attention_mass(query, key, scaling)
        if self.window:
            obs["window_queries"] = query[:, :, -self.window :].float() * scaling  # (B, Hq, W, D)
            tk = key.shape[-2]
            obs["window_positions"] = torch.arange(max(0, tk - self.window), tk, device=key.device)  # (W,)


@dataclass
class StepObserver:
    """Observes forwards on a cache that already evicts (decode steps, and chunks after the first):

    - adds each new query's attention to the running `attn_mass` of the evicting layers that keep one;
    - slides each evicting layer's `window_queries` on: they become the last `window` queries the layer has seen,
      this forward's last ones at their absolute positions after the newest of those it held (SnapKV's window taken
      from the latest chunk; TOVA's current query while decoding). `window` 0: as many as the layer holds, which
      is what the prefill recorded for the variants it served.
    """

    window: int = 0

    def record(self, layer_idx: int, layer, query: Tensor, key: Tensor, scaling: float) -> None:
        state = getattr(layer, "state", None)
        if state is None:  # a plain (sliding-window) layer
            return
        if "attn_mass" in state:
            state["attn_mass"] = state["attn_mass"] + attention_mass(query, key, scaling)
        held = layer.observations.get("window_queries")
        w = self.window or (held.shape[-2] if held is not None else 0)
        if not w:
            return
        new = min(w, query.shape[-2])
        queries = query[:, :, -new:].float() * scaling
        positions = torch.arange(layer.seen - new, layer.seen, device=key.device)
        if new < w and held is not None:  # fewer new queries than the window: keep the newest of the held ones
            queries = torch.cat([held, queries], dim=2)[:, :, -w:]
            positions = torch.cat([layer.observations["window_positions"], positions])[-w:]
        # a new dict: caches that share this layer's tensors keep their own observations
        layer.observations = {**layer.observations, "window_queries": queries, "window_positions": positions}


@contextmanager
def observe(observer, cache):
    """Within the block, every forward through the model reports its attention to `observer`."""
    token = _observer.set((observer, cache))
    try:
        yield observer
    finally:
        _observer.reset(token)


OWNER = "evalkit_owner"  # set on keys a cache layer returns when it attends over its own storage


def owned(x: Tensor, layer) -> Tensor:
    """A view of x, as returned by `layer.update()`, telling `evalkit_sdpa` to let `layer.attend` compute the
    attention: a quantized layer that decodes over its packed store returns only its residual window."""
    x = x.view_as(x)
    setattr(x, OWNER, layer)
    return x


def evalkit_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA plus observation. Also rebuilds the causal mask for layers that hold a different number of tokens than
    the layer transformers built the shared mask for (per-layer budgets, e.g. PyramidKV), and hands the attention to
    a cache layer that attends over its packed storage itself (keys marked by `owned`), observed or not."""
    owner = getattr(key, OWNER, None)
    if owner is not None:
        return owner.attend(module, query, attention_mask, **kwargs)
    active = _observer.get()
    attention_mask = fit_mask(attention_mask, query, key)
    if active is not None:
        scaling = kwargs.get("scaling") or module.scaling
        active[0].record(module.layer_idx, active[1].layers[module.layer_idx], query, key, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def fit_mask(attention_mask: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
    """The shared mask if it fits this layer's keys, else the causal mask for queries that are the last keys."""
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        return causal_tail_mask(query.shape[-2], key.shape[-2], query.device)
    return attention_mask


def register() -> str:
    """Make `evalkit_sdpa` available to every model; returns its name for `set_attn_implementation`."""
    AttentionInterface.register(NAME, evalkit_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
