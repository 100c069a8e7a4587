"""Attention that policies can observe, registered through transformers' public AttentionInterface.

The registered function hands the output to transformers' own SDPA forward, so logits are those of plain SDPA, and
hands each layer's attention (`Attended`: the post-RoPE queries and keys) to the recorder its forward was given
(`observe`), which records what the policies declared they need (evalkit.attention.observation). Where an
observation reads the attention mass (H2O), the output and the mass come from one softmax (evalkit.attention.fused).
It also masks a ragged layer's padding, fits the causal mask to a layer that holds fewer tokens than the shared mask
was built for, and lets a cache layer that attends over its own packed storage do so.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from evalkit.attention.fused import attend_with_mass
from evalkit.attention.observation import Attended

VALID = "evalkit_valid"  # on keys from a ragged cache layer (evalkit.kv.cache): its (B, Hkv, T) mask of real slots

NAME = "evalkit_sdpa"

OBSERVED = "evalkit_observed"  # the forward's keyword that carries (recorder, cache): see observe


def causal_tail_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """(1, 1, q, k) bool: the q queries are the last q keys; each sees every earlier key and itself."""
    q_idx = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return (torch.arange(k_len, device=device)[None, :] <= q_idx)[None, None]


def observe(recorder, cache) -> dict[str, tuple]:
    """The keyword a forward is given (`model(..., **observe(recorder, cache))`) for `evalkit_sdpa` to hand every
    layer's attention in that forward to `recorder` (evalkit.attention.observation.Recorder); transformers passes
    a forward's keywords down to its attention function."""
    return {OBSERVED: (recorder, cache)}


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
    active = kwargs.pop(OBSERVED, None)
    owner = getattr(key, OWNER, None)
    if owner is not None:
        return owner.attend(module, query, attention_mask, **kwargs)
    attention_mask = fit_mask(attention_mask, query, key)
    valid = getattr(key, VALID, None)
    if valid is not None:  # a ragged layer: each KV head masks its own padding slots
        attention_mask = mask_padding(attention_mask, valid, query)
    if active is not None:
        recorder, cache = active
        layer, scaling = cache.layers[module.layer_idx], kwargs.get("scaling") or module.scaling
        at = Attended(None, query, key, scaling, getattr(layer, "seen", key.shape[-2]))
        if recorder.wants_mass(module.layer_idx, layer) and plain_softmax(kwargs):
            # H2O: the output and the mass from the same probabilities, one pass (evalkit.attention.fused)
            workspace = getattr(recorder, "workspace", None)
            output, at.given_mass = attend_with_mass(query, key, value, scaling, attention_mask, workspace=workspace)
            recorder.record(module.layer_idx, layer, at)
            return output, None
        recorder.record(module.layer_idx, layer, at)
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
