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

from evalkit.kv.fused import attend_with_mass

VALID = "evalkit_valid"  # on keys from a ragged cache layer (evalkit.kv.cache): its (B, Hkv, T) mask of real slots

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
    # Need.QUERY_STATS: the statistics of the pre-RoPE queries from each of these positions on (ExpectedAttention),
    # and the model's rotary embedding (model.model.rotary_emb), whose RoPE the queries are rotated back by
    query_stats: tuple[int, ...] = ()
    rotary: torch.nn.Module | None = None
    # buffers the fused attention reuses from layer to layer of this prefill (evalkit.kv.fused): its float32 output
    # and its score buffer, not a new pair per layer between the cache's tensors
    workspace: dict[str, Tensor] = field(default_factory=dict)

    def wants_mass(self, layer) -> bool:
        """Whether this forward's attention mass is recorded for `layer` (then evalkit_sdpa computes it with the
        output, evalkit.fused, and hands it to `record`)."""
        return self.mass and not getattr(layer, "is_sliding", False)

    def record(
        self, layer_idx: int, layer, query: Tensor, key: Tensor, scaling: float, mass: Tensor | None = None
    ) -> None:
        if getattr(layer, "is_sliding", False):
            return
        obs = self.observations.setdefault(layer_idx, {})
        if self.mass:
            obs["attn_mass"] = mass if mass is not None else attention_mass(query, key, scaling)
        if self.window:
            obs["window_queries"] = query[:, :, -self.window :].float() * scaling  # (B, Hq, W, D)
            tk = key.shape[-2]
            obs["window_positions"] = torch.arange(max(0, tk - self.window), tk, device=key.device)  # (W,)
        if self.query_stats:
            self.record_query_stats(obs, query, key.shape[-2])

    def record_query_stats(self, obs: dict[str, Tensor], query: Tensor, tk: int, chunk: int = 1024) -> None:
        """For each s in `query_stats`: `query_mean:{s}` (B, Hq, D) and `query_cov:{s}` (B, Hq, D, D) of the pre-RoPE
        queries at positions s.. (the covariance divided by their count, not count - 1); and the RoPE's `rope_inv_freq`
        (D/2,) and `rope_scaling` (). The post-RoPE queries (the last Tq of the tk tokens) are rotated back by their
        positions, the cos and sin computed as transformers' rotary embeddings do. Two passes (mean, then centred
        products) over `chunk` queries at a time: memory O(chunk x D) beyond the statistics."""
        if self.rotary is None:
            raise ValueError("Need.QUERY_STATS: the model's rotary embedding was not given to the observer")
        inv_freq = getattr(self.rotary, "inv_freq", None)
        attn_scaling = getattr(self.rotary, "attention_scaling", 1.0)
        if inv_freq is None:  # one RoPE per layer type (Gemma 3): the full-attention layers'
            inv_freq = self.rotary.full_attention_inv_freq
            attn_scaling = self.rotary.full_attention_attention_scaling
        b, hq, tq, d = query.shape
        if 2 * inv_freq.shape[-1] != d:
            raise ValueError(f"Need.QUERY_STATS: RoPE over {2 * inv_freq.shape[-1]} of {d} head dims is not supported")
        inv_freq = inv_freq.to(query.device, torch.float32)
        obs["rope_inv_freq"] = inv_freq
        obs["rope_scaling"] = torch.tensor(float(attn_scaling), device=query.device)

        def pre_rope(lo: int, hi: int) -> Tensor:  # (B, Hq, hi - lo, D): queries lo..hi-1 of this forward
            pos = torch.arange(tk - tq + lo, tk - tq + hi, device=query.device, dtype=torch.float32)
            angles = pos[:, None] * inv_freq[None, :]
            cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
            q = query[:, :, lo:hi].float()
            q_half = torch.cat([q[..., d // 2 :], -q[..., : d // 2]], dim=-1)  # the inverse of rotate_half
            return (q * cos + q_half * sin) / attn_scaling

        for start in self.query_stats:
            first = max(0, start - (tk - tq))
            n = tq - first
            if n < 1:
                continue
            spans = [(lo, min(lo + chunk, tq)) for lo in range(first, tq, chunk)]
            mean = sum(pre_rope(lo, hi).sum(dim=2) for lo, hi in spans) / n  # (B, Hq, D)
            cov = query.new_zeros(b, hq, d, d, dtype=torch.float32)
            for lo, hi in spans:
                centred = pre_rope(lo, hi) - mean[:, :, None]
                cov += centred.transpose(-1, -2) @ centred
            obs[f"query_mean:{start}"], obs[f"query_cov:{start}"] = mean, cov / n


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

    def wants_mass(self, layer) -> bool:
        """Whether `layer` keeps a running attention mass (H2O), which this forward's attention adds to."""
        return "attn_mass" in (getattr(layer, "state", None) or {})

    def record(
        self, layer_idx: int, layer, query: Tensor, key: Tensor, scaling: float, mass: Tensor | None = None
    ) -> None:
        state = getattr(layer, "state", None)
        if state is None:  # a plain (sliding-window) layer
            return
        if "attn_mass" in state:
            added = mass if mass is not None else attention_mass(query, key, scaling)
            state["attn_mass"] = state["attn_mass"] + added
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


def reconstruction_key(sinks: int, chunk: int, plus: bool = False) -> str:
    """The observation that holds the scores of a reconstruction pass with these settings (KVzip; `plus`: KVzip+)."""
    return f"reconstruction:{sinks}:{chunk}" + (":plus" if plus else "")


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
    valid = getattr(key, VALID, None)
    if valid is not None:  # a ragged layer: each KV head masks its own padding slots
        attention_mask = mask_padding(attention_mask, valid, query)
    if active is not None:
        observer, cache = active
        layer, scaling = cache.layers[module.layer_idx], kwargs.get("scaling") or module.scaling
        if getattr(observer, "wants_mass", None) and observer.wants_mass(layer) and plain_softmax(kwargs):
            # H2O: the output and the mass from the same probabilities, one pass (evalkit.fused)
            workspace = getattr(observer, "workspace", None)
            output, mass = attend_with_mass(query, key, value, scaling, attention_mask, workspace=workspace)
            observer.record(module.layer_idx, layer, query, key, scaling, mass=mass)
            return output, None
        observer.record(module.layer_idx, layer, query, key, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def plain_softmax(kwargs: dict) -> bool:
    """Whether the attention is a plain scaled softmax that `attend_with_mass` computes as SDPA would: no logit
    soft-capping, sliding window, attention sinks or dropout (models that use them take SDPA plus a second pass)."""
    return not any(kwargs.get(k) for k in ("softcap", "sliding_window", "s_aux", "dropout"))


def fit_mask(attention_mask: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
    """The shared mask if it fits this layer's keys, else the causal mask for queries that are the last keys."""
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        return causal_tail_mask(query.shape[-2], key.shape[-2], query.device)
    return attention_mask


def mask_padding(attention_mask: Tensor | None, valid: Tensor, query: Tensor) -> Tensor:
    """(B, Hq, q, k) bool: the layer's mask (causal when None) and, per KV head, only its real slots (`valid`,
    (B, Hkv, k)), repeated over the query heads of each KV group."""
    q_len, k_len = query.shape[-2], valid.shape[-1]
    if attention_mask is None:
        attention_mask = causal_tail_mask(q_len, k_len, query.device)
    elif attention_mask.dtype != torch.bool:  # additive: 0 where attended
        attention_mask = attention_mask == 0
    heads = valid.repeat_interleave(query.shape[1] // valid.shape[1], dim=1)  # (B, Hq, k)
    return attention_mask & heads[:, :, None, :]


def register() -> str:
    """Make `evalkit_sdpa` available to every model; returns its name for `set_attn_implementation`."""
    AttentionInterface.register(NAME, evalkit_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
