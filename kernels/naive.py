"""Plain PyTorch references for the quantization kernels, with the kernels' signatures.

Asymmetric min/max quantization in groups along the last dimension (KIVI, Liu et al. 2024, arXiv:2402.02750):
for each group of `group` consecutive elements, scale = (max - min) / (2**bits - 1) and
q = floor((x - min) / scale + 1/2), stored as `bits`-bit codes packed little-end-first into uint8
(8 bits: one code a byte; 4 bits: two; 2 bits: four). Keys are quantized per channel (groups run along the
tokens: pass keys transposed) and values per token (groups run along the channels).
"""

from __future__ import annotations

import torch
from torch import Tensor

BITS = (2, 4, 8)


def codes_per_byte(bits: int) -> int:
    return 8 // bits


def quantize(x: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """x (R, C) float -> (packed (R, C * bits / 8) uint8, scale (R, C / group) fp16, minimum (R, C / group) fp16)."""
    r, c = x.shape
    if r * c == 0:
        empty = x.new_zeros(r, c // group, dtype=torch.float16)
        return x.new_zeros(r, c * bits // 8, dtype=torch.uint8), empty, empty.clone()
    g = x.float().view(r, c // group, group)
    mn = g.amin(dim=-1, keepdim=True).half().float()  # stored in fp16: quantize against what will be read back
    scale = ((g.amax(dim=-1, keepdim=True) - mn) / (2**bits - 1)).half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor((g - mn) / safe + 0.5).clamp_(0, 2**bits - 1).to(torch.uint8).view(r, c)  # round half up
    return pack(q, bits), scale.view(r, -1).half(), mn.view(r, -1).half()


def dequantize(packed: Tensor, scale: Tensor, mn: Tensor, bits: int, group: int) -> Tensor:
    """The inverse of `quantize`, up to the quantization step: (R, C) float32."""
    q = unpack(packed, bits).float()
    r, c = q.shape
    return (q.view(r, c // group, group) * scale.float()[..., None] + mn.float()[..., None]).view(r, c)


def pack(q: Tensor, bits: int) -> Tensor:
    """(R, C) uint8 codes < 2**bits -> (R, C * bits / 8) uint8; code j sits at bits (j % n) * bits of byte j // n."""
    n = codes_per_byte(bits)
    r, c = q.shape
    shifts = torch.arange(n, device=q.device, dtype=torch.uint8) * bits
    return (q.view(r, c // n, n) << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """(R, C * bits / 8) uint8 -> (R, C) uint8 codes."""
    n = codes_per_byte(bits)
    r, b = packed.shape
    shifts = torch.arange(n, device=packed.device, dtype=torch.uint8) * bits
    return ((packed[..., None] >> shifts) & (2**bits - 1)).view(r, b * n)


def decode_attention(
    query: Tensor,
    key_packed: Tensor,
    key_scale: Tensor,
    key_min: Tensor,
    value_packed: Tensor,
    value_scale: Tensor,
    value_min: Tensor,
    key_residual: Tensor,
    value_residual: Tensor,
    bits: int,
    group: int,
    scaling: float,
) -> Tensor:
    """One query token against a quantized history plus a full-precision residual window.

    query (B, Hq, D); per KV head h: keys quantized per channel, key_packed (B, Hkv, D, Tq*bits/8) with
    key_scale/key_min (B, Hkv, D, Tq/group); values per token, value_packed (B, Hkv, Tq, D*bits/8) with
    value_scale/value_min (B, Hkv, Tq, D/group); residual keys/values (B, Hkv, Tr, D). Returns (B, Hq, D) float32.
    """
    b, hq, d = query.shape
    hkv = key_packed.shape[1]
    keys = dequantize(key_packed.flatten(0, 2), key_scale.flatten(0, 2), key_min.flatten(0, 2), bits, group)
    keys = keys.view(b, hkv, d, -1).transpose(-1, -2)  # (B, Hkv, Tq, D)
    values = dequantize(value_packed.flatten(0, 2), value_scale.flatten(0, 2), value_min.flatten(0, 2), bits, group)
    values = values.view(b, hkv, -1, d)
    keys = torch.cat([keys, key_residual.float()], dim=2).repeat_interleave(hq // hkv, dim=1)
    values = torch.cat([values, value_residual.float()], dim=2).repeat_interleave(hq // hkv, dim=1)
    probs = (torch.einsum("bhd,bhtd->bht", query.float(), keys) * scaling).softmax(dim=-1)
    return torch.einsum("bht,bhtd->bhd", probs, values)


def attention_with_mass(query: Tensor, key: Tensor, value: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """The plain reference of `attention_mass.attention_with_mass`: the whole (Tq x Tk) softmax materialised, each
    query head over its KV head's keys (queries are the last Tq keys, causal); returns the output (B, Tq, Hq, D) in
    the query's dtype and the mass (B, Hkv, Tk) float32, the probabilities summed over queries and each group."""
    b, hq, tq, _ = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    group = hq // hkv
    k, v = key.float().repeat_interleave(group, dim=1), value.float().repeat_interleave(group, dim=1)
    scores = (query.float() @ k.transpose(-1, -2)) * scaling
    seen = torch.arange(tk, device=key.device)[None, :] <= torch.arange(tq, device=key.device)[:, None] + tk - tq
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    mass = probs.sum(dim=2).view(b, hkv, group, tk).sum(dim=2)
    return (probs @ v).transpose(1, 2).to(query.dtype), mass
