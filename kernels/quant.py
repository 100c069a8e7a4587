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
    _dequantize_kernel[(r, c // group)](
        packed.contiguous(), scale.contiguous(), mn.contiguous(), out, c, BITS=bits, GROUP=group
    )
    return out


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v):
    """Fold one block of scores s (BLOCK,) and values v (BLOCK, D) into the running max, denominator, numerator."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    p = tl.exp(s - m_new)
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def _packed_keys(kp_ptr, ks_ptr, km_ptr, h, d, t, valid, TQ, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Keys of tokens `t`, per channel: (D, BLOCK) codes from bytes along the tokens, a scale and a minimum per
    (channel, token group)."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = 2**BITS - 1
    kmask = valid[None, :]
    kb = tl.load(kp_ptr + (h * D + d[:, None]) * (TQ // PER) + t[None, :] // PER, mask=kmask, other=0)
    kq = (kb.to(tl.int32) >> ((t[None, :] % PER) * BITS)) & MASK
    kidx = (h * D + d[:, None]) * (TQ // GROUP) + t[None, :] // GROUP
    k_scale = tl.load(ks_ptr + kidx, mask=kmask, other=0).to(tl.float32)
    k = kq.to(tl.float32) * k_scale + tl.load(km_ptr + kidx, mask=kmask, other=0).to(tl.float32)
    return k


@triton.jit
def _packed_values(
    vp_ptr, vs_ptr, vm_ptr, h, d, t, valid, TQ, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr
):
    """Values of tokens `t`, per token: (BLOCK, D) codes from bytes along the channels, a scale and a minimum per
    (token, channel group)."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = 2**BITS - 1
    vmask = valid[:, None]
    vb = tl.load(vp_ptr + (h * TQ + t[:, None]) * (D // PER) + d[None, :] // PER, mask=vmask, other=0)
    vq = (vb.to(tl.int32) >> ((d[None, :] % PER) * BITS)) & MASK
    vidx = (h * TQ + t[:, None]) * (D // GROUP) + d[None, :] // GROUP
    v_scale = tl.load(vs_ptr + vidx, mask=vmask, other=0).to(tl.float32)
    v = vq.to(tl.float32) * v_scale + tl.load(vm_ptr + vidx, mask=vmask, other=0).to(tl.float32)
    return v


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    kp_ptr,
    ks_ptr,
    km_ptr,
    vp_ptr,
    vs_ptr,
    vm_ptr,
    kr_ptr,
    vr_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    HQ,
    HKV,
    TQ,
    TR,
    SPLITS,
    SPLIT_LEN,
    scaling,
    D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Split-K decode attention (flash-decoding): program (batch x query head, split) runs an online softmax
    over its share of the packed history, or over the residual window for the last split, and writes the
    partial max, denominator and numerator; `decode_attention` merges the splits."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    h = (pid // HQ) * HKV + (pid % HQ) // (HQ // HKV)  # flat (batch, kv head)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + pid * D + d).to(tl.float32) * scaling
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    if split < SPLITS - 1:
        lo = split * SPLIT_LEN
        hi = tl.minimum(lo + SPLIT_LEN, TQ)
        for start in range(lo, hi, BLOCK):
            t = start + tl.arange(0, BLOCK)
            valid = t < hi
            k = _packed_keys(kp_ptr, ks_ptr, km_ptr, h, d, t, valid, TQ, D, BITS, GROUP)
            s = tl.where(valid, tl.sum(q[:, None] * k, axis=0), -float("inf"))
            v = _packed_values(vp_ptr, vs_ptr, vm_ptr, h, d, t, valid, TQ, D, BITS, GROUP)
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v)
    else:
        for start in range(0, TR, BLOCK):
            t = start + tl.arange(0, BLOCK)
            valid = t < TR
            k = tl.load(kr_ptr + (h * TR + t[:, None]) * D + d[None, :], mask=valid[:, None], other=0).to(tl.float32)
            v = tl.load(vr_ptr + (h * TR + t[:, None]) * D + d[None, :], mask=valid[:, None], other=0).to(tl.float32)
            s = tl.where(valid, tl.sum(k * q[None, :], axis=1), -float("inf"))
            m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v)
    out = pid * SPLITS + split
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)
    tl.store(acc_ptr + out * D + d, acc)


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
    split_len: int = 1024,
) -> Tensor:
    b, hq, d = query.shape
    hkv = key_packed.shape[1]
    tq = value_packed.shape[2]
    tr = key_residual.shape[2]
    block = max(group, 8 // bits)
    split_len = max(block, split_len // block * block)
    splits = triton.cdiv(tq, split_len) + 1  # the packed history in splits, then the residual window
    m = torch.empty(b * hq, splits, dtype=torch.float32, device=query.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(b * hq, splits, d, dtype=torch.float32, device=query.device)
    _decode_attention_kernel[(b * hq, splits)](
        query.contiguous(),
        key_packed.contiguous(),
        key_scale.contiguous(),
        key_min.contiguous(),
        value_packed.contiguous(),
        value_scale.contiguous(),
        value_min.contiguous(),
        key_residual.contiguous(),
        value_residual.contiguous(),
        m,
        l_sum,
        acc,
        hq,
        hkv,
        tq,
        tr,
        splits,
        split_len,
        scaling,
        D=d,
        BITS=bits,
        GROUP=group,
        BLOCK=block,
    )
    weight = torch.exp(m - m.amax(dim=1, keepdim=True))  # (B*Hq, S); an empty split has weight 0
    out = (weight[..., None] * acc).sum(dim=1) / (weight * l_sum).sum(dim=1, keepdim=True)
    return out.view(b, hq, d)
