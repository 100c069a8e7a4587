"""Quantized KV kernels: Triton on CUDA (or on the CPU under TRITON_INTERPRET=1), PyTorch references elsewhere.

`quantize`, `dequantize` and `decode_attention` have the same signatures in `naive.py` (the references) and in
`quant.py` (the Triton kernels); `use_triton` says which one a tensor gets.
"""

from __future__ import annotations

import importlib.util
import os

from torch import Tensor

from evalkit.kernels import naive

BITS = naive.BITS


def use_triton(x: Tensor) -> bool:
    """Triton for CUDA tensors, and for CPU tensors when TRITON_INTERPRET=1; the references otherwise."""
    if importlib.util.find_spec("triton") is None:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _impl(x: Tensor):
    if use_triton(x):
        from evalkit.kernels import quant

        return quant
    return naive


def quantize(x: Tensor, bits: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    return _impl(x).quantize(x, bits, group)


def dequantize(packed: Tensor, scale: Tensor, mn: Tensor, bits: int, group: int) -> Tensor:
    return _impl(packed).dequantize(packed, scale, mn, bits, group)


def quantize_kv(keys: Tensor, values: Tensor, bits: int, group: int) -> tuple[Tensor, ...]:
    """Keys per channel and values per token, KIVI's layout: (B, H, T, D) each -> the six packed tensors
    `decode_attention` reads: key codes (B, H, D, T*bits/8), key scale and minimum (B, H, D, T/group), value codes
    (B, H, T, D*bits/8), value scale and minimum (B, H, T, D/group)."""
    b, h, t, d = keys.shape
    kp, ks, km = quantize(keys.float().transpose(-1, -2).reshape(b * h * d, t), bits, group)
    vp, vs, vm = quantize(values.float().reshape(b * h * t, d), bits, group)
    nk, nv = t // group, d // group
    return (
        kp.view(b, h, d, t * bits // 8),
        ks.view(b, h, d, nk),
        km.view(b, h, d, nk),
        vp.view(b, h, t, d * bits // 8),
        vs.view(b, h, t, nv),
        vm.view(b, h, t, nv),
    )


def decode_attention(query: Tensor, *args, **kwargs) -> Tensor:
    return _impl(query).decode_attention(query, *args, **kwargs)
