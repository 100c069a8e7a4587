"""Attention that policies can observe, registered through transformers' public AttentionInterface.

The registered function hands the output to transformers' own SDPA forward, so logits are those of plain SDPA, and
hands each layer's attention (`Attended`: the post-RoPE queries and keys) to the recorder its forward was given
(`observe`), which records what the policies declared they need (evalkit.attention.observation). Where an
observation reads the attention mass (H2O), the output and the mass come from one softmax (evalkit.attention.fused).
It also masks a ragged layer's padding, fits the causal mask to a layer that holds fewer tokens than the shared mask
was built for, and lets a cache layer that attends over its own storage do so.

A sliding-window layer prefilled in one shot (Gemma 3: 15 of 18 layers, a window of 512) is given by transformers the
whole (T x T) mask, and SDPA on it computes every query against every key only to mask all but the window: quadratic
work for a banded result (the floor of the scale benchmark grew with slope 1.9 to 32k because of it). `sdpa` hands
SDPA one block of queries at a time with the keys its mask rows allow (`bands`, checked on the mask itself), so the
output is SDPA's over the same unmasked keys (equal up to float rounding) at a cost linear in the context; KVzip's
pass attends its sliding layers the same way.

transformers hands an attention function the forward's keywords, not the cache: every forward evalkit runs over one of
its caches therefore names the cache in one keyword (`observe(recorder, cache)`, the recorder None where nothing is
observed), and the layer's attention reads what it needs from the layer itself, never from attributes set on tensors:
- `layer.valid`: (B, Hkv, T) False on a ragged layer's padding slots (evalkit.kv.cache), masked out here;
- `layer.attends(query)`: True where the layer computes this forward's attention itself (`layer.attend`): a
  quantized layer decoding over its packed store (evalkit.kv.quantized), one row of a batched decode
  (evalkit.engine.decode), KVzip's reconstruction pass (policies/kvzip_pass.py).
Those layers refuse, in their `update`, a forward that did not name its cache (`require_named`): without the keyword
their keys would be attended as plain SDPA, padding and all.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from evalkit.attention.fused import attend_with_mass
from evalkit.attention.observation import Attended

NAME = "evalkit_sdpa"

FORWARD = "evalkit_forward"  # the forward's keyword that carries (recorder, cache): see observe


def causal_tail_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """(1, 1, q, k) bool: the q queries are the last q keys; each sees every earlier key and itself."""
    q_idx = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return (torch.arange(k_len, device=device)[None, :] <= q_idx)[None, None]


def observe(recorder, cache) -> dict[str, tuple]:
    """The keyword every forward over an evalkit cache is given (`model(..., **observe(recorder, cache))`): it names
    the cache to `evalkit_sdpa` (see the module doc) and hands every layer's attention in that forward to `recorder`
    (evalkit.attention.observation.Recorder; None: nothing is recorded). transformers passes a forward's keywords
    down to its attention function."""
    return {FORWARD: (recorder, cache)}


def require_named(update_kwargs: dict, layer) -> None:
    """In the `update` of a layer whose returned keys are not the whole attention without `evalkit_sdpa` (padding to
    mask, a store it attends itself): refuse a model forward that did not name its cache, which would otherwise be
    plain SDPA over those keys. transformers hands the cache the forward's keywords (`kwargs=`); a direct call to
    `update()` hands none and is not checked."""
    forward = update_kwargs.get("kwargs")
    if forward is not None and FORWARD not in forward:
        raise RuntimeError(
            f"a forward over a {type(layer).__name__} without observe(recorder, cache): its attention needs the layer "
            "(evalkit.attention.sdpa); pass **observe(None, cache) to the model"
        )


def evalkit_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA plus observation. Also rebuilds the causal mask for layers that hold a different number of tokens than
    the layer transformers built the shared mask for (per-layer budgets, e.g. PyramidKV), masks a ragged layer's
    padding, and hands the attention to a cache layer that computes it itself (`layer.attends`), observed or not.
    A forward without the keyword (no evalkit cache) is plain SDPA."""
    active = kwargs.pop(FORWARD, None)
    if active is None:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    recorder, cache = active
    layer = cache.layers[module.layer_idx]
    attends = getattr(layer, "attends", None)
    if attends is not None and attends(query):
        return layer.attend(module, query, attention_mask, **kwargs)
    attention_mask = fit_mask(attention_mask, query, key)
    valid = getattr(layer, "valid", None)
    if valid is not None:  # a ragged layer: each KV head masks its own padding slots
        attention_mask = mask_padding(attention_mask, valid, query)
    if recorder is not None:
        scaling = kwargs.get("scaling") or module.scaling
        at = Attended(None, query, key, scaling, getattr(layer, "seen", key.shape[-2]))
        if recorder.wants_mass(module.layer_idx, layer) and plain_softmax(kwargs):
            # H2O: the output and the mass from the same probabilities, one pass (evalkit.attention.fused)
            workspace = getattr(recorder, "workspace", None)
            output, at.given_mass = attend_with_mass(query, key, value, scaling, attention_mask, workspace=workspace)
            recorder.record(module.layer_idx, layer, at)
            return output, None
        recorder.record(module.layer_idx, layer, at)
    return sdpa(module, query, key, value, attention_mask, **kwargs)


BANDED_FROM = 2  # a sliding layer attends band by band from 2 windows of keys (at 2: 0.03 s against SDPA's 0.06 s)


def sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA forward; for a sliding-window layer over many windows of keys (a one-shot prefill, KVzip's
    pass), a band at a time (`bands`)."""
    window = kwargs.get("sliding_window")
    q, k = query.shape[-2], key.shape[-2]
    if (
        not window
        or k < BANDED_FROM * window
        or attention_mask is None
        or attention_mask.dtype != torch.bool
        or attention_mask.shape[-2:] != (q, k)
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out = []
    for a, b, start, stop in bands(attention_mask, window):
        rows, keys = slice(a, b), slice(start, stop)
        part, _ = sdpa_attention_forward(
            module, query[:, :, rows], key[:, :, keys], value[:, :, keys], attention_mask[..., rows, keys], **kwargs
        )
        out.append(part)
    return torch.cat(out, dim=1), None


def bands(mask: Tensor, window: int) -> list[tuple[int, int, int, int]]:
    """(a, b, start, stop) per block of half a window of queries a..b-1 of a (.., q, k) boolean mask whose queries are
    the last q of the k keys: the keys start..stop-1 hold every key the block's rows attend (a sliding window's:
    k - q + a - window + 1 .. k - q + b - 1). Read off the mask, not assumed: a block whose rows attend a key outside
    the band is given every key (start = 0, stop = k). Blocks of half a window measured fastest on the CPU (Gemma 3's
    shapes at 8k, one thread: 0.33 s against 0.43 s for a whole window and 3.36 s for SDPA over the whole mask)."""
    q, k = mask.shape[-2:]
    block, off = max(1, window // 2), k - q
    out = []
    for a in range(0, q, block):
        b = min(q, a + block)
        start, stop, rows = max(0, off + a - window + 1), off + b, mask[..., a:b, :]
        if rows[..., :start].any() or rows[..., stop:].any():
            out.append((a, b, 0, k))
        else:
            out.append((a, b, start, stop))
    return out


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
