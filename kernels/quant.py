"""Triton kernels: quantize-and-pack, unpack-and-dequantize, and decode attention over packed KV.

Each has the signature of its reference in `naive.py`; `evalkit.kernels` picks one or the other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _quantize_kernel(x_ptr, packed_ptr, scale_ptr, min_ptr, C, BITS: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    PER: tl.constexpr = 8 // BITS
    NB: tl.constexpr = GROUP // PER
    byte = tl.arange(0, NB)[:, None]
    slot = tl.arange(0, PER)[None, :]
    x = tl.load(x_ptr + row * C + grp * GROUP + byte * PER + slot).to(tl.float32)  # (NB, PER)
    mn = tl.min(tl.min(x, axis=1), axis=0).to(tl.float16).to(tl.float32)
    mx = tl.max(tl.max(x, axis=1), axis=0)
    scale = ((mx - mn) / (2**BITS - 1)).to(tl.float16).to(tl.float32)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.floor((x - mn) / safe + 0.5)
    q = tl.minimum(tl.maximum(q, 0.0), 2**BITS - 1).to(tl.int32)
    packed = tl.sum(q << (slot * BITS), axis=1)  # (NB,)
    tl.store(packed_ptr + row * (C // PER) + grp * NB + tl.arange(0, NB), packed.to(tl.uint8))
    tl.store(scale_ptr + row * (C // GROUP) + grp, scale.to(tl.float16))
    tl.store(min_ptr + row * (C // GROUP) + grp, mn.to(tl.float16))


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, min_ptr, out_ptr, C, BITS: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    PER: tl.constexpr = 8 // BITS
    col = grp * GROUP + tl.arange(0, GROUP)
    byte = tl.load(packed_ptr + row * (C // PER) + col // PER).to(tl.int32)
    q = (byte >> ((col % PER) * BITS)) & (2**BITS - 1)
    scale = tl.load(scale_ptr + row * (C // GROUP) + grp).to(tl.float32)
    mn = tl.load(min_ptr + row * (C // GROUP) + grp).to(tl.float32)
    tl.store(out_ptr + row * C + col, q.to(tl.float32) * scale + mn)


def quantize(x: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    r, c = x.shape
    x = x.contiguous()
    packed = torch.empty(r, c * bits // 8, dtype=torch.uint8, device=x.device)
    scale = torch.empty(r, c // group, dtype=torch.float16, device=x.device)
    mn = torch.empty_like(scale)
    if r * c == 0:
        return packed, scale, mn
    _quantize_kernel[(r, c // group)](x, packed, scale, mn, c, BITS=bits, GROUP=group)
    return packed, scale, mn


def dequantize(packed: Tensor, scale: Tensor, mn: Tensor, bits: int, group: int) -> Tensor:
    r = packed.shape[0]
    c = packed.shape[1] * 8 // bits
    out = torch.empty(r, c, dtype=torch.float32, device=packed.device)
    if r * c == 0:
        return out
    _dequantize_kernel[(r, c // group)](packed.contiguous(), scale.contiguous(), mn.contiguous(), out, c,
                                        BITS=bits, GROUP=group)
    return out


@triton.jit
def _decode_attention_kernel(
    q_ptr, kp_ptr, ks_ptr, km_ptr, vp_ptr, vs_ptr, vm_ptr, kr_ptr, vr_ptr, out_ptr,
    HQ, HKV, TQ, TR, scaling,
    D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per (batch, query head): online softmax over the packed history, then the residual."""
    pid = tl.program_id(0)
    b = pid // HQ
    hq = pid % HQ
    h = b * HKV + hq // (HQ // HKV)  # flat (batch, kv head)
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = 2**BITS - 1
    d = tl.arange(0, D)
    q = tl.load(q_ptr + pid * D + d).to(tl.float32) * scaling
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    for start in range(0, TQ, BLOCK):
        t = start + tl.arange(0, BLOCK)
        valid = t < TQ
        # keys, per channel: (D, BLOCK) codes from bytes along the tokens, one scale per (channel, token group)
        kb = tl.load(kp_ptr + (h * D + d[:, None]) * (TQ // PER) + t[None, :] // PER, mask=valid[None, :], other=0)
        kq = (kb.to(tl.int32) >> ((t[None, :] % PER) * BITS)) & MASK
        kidx = (h * D + d[:, None]) * (TQ // GROUP) + t[None, :] // GROUP
        k = kq.to(tl.float32) * tl.load(ks_ptr + kidx, mask=valid[None, :], other=0).to(tl.float32) + tl.load(
            km_ptr + kidx, mask=valid[None, :], other=0
        ).to(tl.float32)
        s = tl.sum(q[:, None] * k, axis=0)
        s = tl.where(valid, s, -float("inf"))
        # values, per token: (BLOCK, D) codes from bytes along the channels
        vb = tl.load(vp_ptr + (h * TQ + t[:, None]) * (D // PER) + d[None, :] // PER, mask=valid[:, None], other=0)
        vq = (vb.to(tl.int32) >> ((d[None, :] % PER) * BITS)) & MASK
        vidx = (h * TQ + t[:, None]) * (D // GROUP) + d[None, :] // GROUP
        v = vq.to(tl.float32) * tl.load(vs_ptr + vidx, mask=valid[:, None], other=0).to(tl.float32) + tl.load(
            vm_ptr + vidx, mask=valid[:, None], other=0
        ).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    for start in range(0, TR, BLOCK):
        t = start + tl.arange(0, BLOCK)
        valid = t < TR
        k = tl.load(kr_ptr + (h * TR + t[:, None]) * D + d[None, :], mask=valid[:, None], other=0).to(tl.float32)
        v = tl.load(vr_ptr + (h * TR + t[:, None]) * D + d[None, :], mask=valid[:, None], other=0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1), -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + pid * D + d, acc / l_i)


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
    b, hq, d = query.shape
    hkv = key_packed.shape[1]
    tq = value_packed.shape[2]
    tr = key_residual.shape[2]
    out = torch.empty(b, hq, d, dtype=torch.float32, device=query.device)
    block = max(group, 8 // bits)
    _decode_attention_kernel[(b * hq,)](
        query.contiguous(), key_packed.contiguous(), key_scale.contiguous(), key_min.contiguous(),
        value_packed.contiguous(), value_scale.contiguous(), value_min.contiguous(),
        key_residual.contiguous(), value_residual.contiguous(), out,
        hq, hkv, tq, tr, scaling, D=d, BITS=bits, GROUP=group, BLOCK=block,
    )
    return out
