"""Triton: causal attention and, from the same kernel, the attention mass each key receives (H2O's score).

Grid: one program per block of BLOCK_M queries of one query head. Pass 1 is the flash-attention forward (online
softmax over key blocks, the output written once) and leaves each query's log-sum-exp; pass 2 walks the same key
blocks again and adds each block's column sums of exp(q.k * scale - lse), the exact probabilities, to the key's mass
(per KV head: the query heads of a group add into the same row, atomically). The (Tq x Tk) matrix never exists. The
reference with the same signature is `naive.attention_with_mass`; on the CPU evalkit computes the same thing in query
chunks (evalkit.attention.fused). Run on a GPU: `python benchmarks/gpu_attention_mass.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

NEG = -1.0e30  # a finite floor for the running max: rows past the end never produce inf - inf


@triton.jit
def _attention_mass_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, mass_ptr, scale, Tq, Tk,
    HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    kvh = b * (HQ // GROUP) + h // GROUP  # the KV head's row among all batches' KV heads
    past = Tk - Tq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Tq
    dim_ok = offs_d < D
    q = tl.load(q_ptr + (bh * Tq + offs_m[:, None]) * D + offs_d[None, :], row_ok[:, None] & dim_ok[None, :], 0.0)
    q = q.to(tl.float32) * scale
    m_i = tl.full((BLOCK_M,), NEG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    end = tl.minimum(Tk, past + (pid_m + 1) * BLOCK_M)  # keys after the block's last query are never seen
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < Tk
        kv_off = (kvh * Tk + offs_n[:, None]) * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, key_ok[:, None] & dim_ok[None, :], 0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, key_ok[:, None] & dim_ok[None, :], 0.0).to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        seen = (offs_n[None, :] <= past + offs_m[:, None]) & key_ok[None, :] & row_ok[:, None]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    safe_l = tl.where(row_ok, l_i, 1.0)
    out = acc / safe_l[:, None]
    o_off = ((b * Tq + offs_m[:, None]) * HQ + h) * D + offs_d[None, :]  # (B, Tq, Hq, D), as SDPA's forward returns
    tl.store(o_ptr + o_off, out, row_ok[:, None] & dim_ok[None, :])
    lse = m_i + tl.log(safe_l)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < Tk
        k = tl.load(k_ptr + (kvh * Tk + offs_n[:, None]) * D + offs_d[None, :], key_ok[:, None] & dim_ok[None, :], 0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)))
        seen = (offs_n[None, :] <= past + offs_m[:, None]) & key_ok[None, :] & row_ok[:, None]
        p = tl.exp(tl.where(seen, s - lse[:, None], float("-inf")))
        tl.atomic_add(mass_ptr + kvh * Tk + offs_n, tl.sum(p, axis=0), mask=key_ok)


def attention_with_mass(
    query: Tensor, key: Tensor, value: Tensor, scaling: float, block_m: int = 64, block_n: int = 64
) -> tuple[Tensor, Tensor]:
    """Causal attention of query (B, Hq, Tq, D), the last Tq of the keys (B, Hkv, Tk, D), and the mass: the output
    (B, Tq, Hq, D) in the query's dtype and (B, Hkv, Tk) float32, each key's probabilities summed over the queries
    and the query heads of its group (`naive.attention_with_mass`'s signature). fp32 inputs multiply in IEEE fp32
    (no TF32), so the output stays within float tolerance of SDPA's."""
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty(b, tq, hq, d, dtype=torch.float32, device=query.device)
    mass = torch.zeros(b, hkv, tk, dtype=torch.float32, device=query.device)
    if tq == 0:
        return out.to(query.dtype), mass
    grid = (triton.cdiv(tq, block_m), b * hq)
    _attention_mass_kernel[grid](
        q, k, v, out, mass, scaling, tq, tk,
        HQ=hq, GROUP=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)), IEEE=query.dtype == torch.float32,
    )  # fmt: skip
    return out.to(query.dtype), mass
