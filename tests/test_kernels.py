"""Triton kernels against their PyTorch references (run on the CPU under TRITON_INTERPRET=1), and the
quantization's own properties. Error bound: dequantized values within half a quantization step (plus fp16
rounding of scale and minimum); attention outputs within 1e-4 of the reference's."""

from __future__ import annotations

import pytest
import torch

from evalkit import kernels
from evalkit.kernels import naive

triton_quant = pytest.importorskip("evalkit.kernels.quant", reason="triton is not installed")

SHAPES = [(3, 64), (5, 128), (17, 256)]  # (rows, columns): odd row counts
CASES = [(bits, group, shape) for bits in (8, 4, 2) for group in (32, 64) for shape in SHAPES if shape[1] % group == 0]


def case_id(case):
    bits, group, (r, c) = case
    return f"int{bits}-g{group}-{r}x{c}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_quantize_kernel_matches_reference(case):
    bits, group, (r, c) = case
    x = torch.randn(r, c, generator=torch.Generator().manual_seed(r * c + bits)) * 3
    want = naive.quantize(x, bits, group)
    got = triton_quant.quantize(x, bits, group)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    codes_got, codes_want = naive.unpack(got[0], bits).int(), naive.unpack(want[0], bits).int()
    assert (codes_got - codes_want).abs().max() <= 1  # a tie may round either way on a GPU's division
    assert (codes_got != codes_want).float().mean() <= 1e-3


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dequantize_kernel_matches_reference(case):
    bits, group, (r, c) = case
    x = torch.randn(r, c, generator=torch.Generator().manual_seed(7))
    packed, scale, mn = naive.quantize(x, bits, group)
    torch.testing.assert_close(
        triton_quant.dequantize(packed, scale, mn, bits, group),
        naive.dequantize(packed, scale, mn, bits, group),
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_round_trip_error_is_within_half_a_step(case):
    bits, group, (r, c) = case
    x = torch.randn(r, c, generator=torch.Generator().manual_seed(3)) * 5
    packed, scale, mn = naive.quantize(x, bits, group)
    err = (naive.dequantize(packed, scale, mn, bits, group) - x).abs().view(r, c // group, group)
    step = scale.float()[..., None]
    # half a step, plus the fp16 rounding of the stored minimum and of the scale times the top code
    bound = step / 2 + 1e-3 * (x.abs().view(r, c // group, group).amax(-1, keepdim=True) + 1)
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_is_exact(bits):
    codes = torch.randint(0, 2**bits, (9, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = naive.pack(codes, bits)
    assert packed.shape == (9, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(naive.unpack(packed, bits), codes)


def test_constant_group_quantizes_exactly():
    x = torch.full((2, 64), 0.75)
    packed, scale, mn = naive.quantize(x, 4, 32)
    assert torch.equal(naive.dequantize(packed, scale, mn, 4, 32), x)


def packed_history(b, hkv, t, tr, d, bits, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(b, hkv, t, d, generator=g), torch.randn(b, hkv, t, d, generator=g)
    residual = torch.randn(b, hkv, tr, d, generator=g), torch.randn(b, hkv, tr, d, generator=g)
    return kernels.quantize_kv(keys, values, bits, group), residual


ATTN = [
    (1, 4, 2, 64, 5, 64, 4, 32),
    (2, 6, 3, 128, 0, 64, 2, 64),
    (1, 2, 2, 96, 17, 32, 8, 32),
    (1, 4, 1, 0, 9, 64, 4, 32),
    (1, 2, 1, 320, 3, 32, 4, 32),
]


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "t", "tr", "d", "bits", "group"),
    ATTN,
    ids=[f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-T{c[3]}-R{c[4]}-D{c[5]}-int{c[6]}-g{c[7]}" for c in ATTN],
)
def test_decode_attention_kernel_matches_reference(b, hq, hkv, t, tr, d, bits, group):
    parts, residual = packed_history(b, hkv, t, tr, d, bits, group)
    q = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(1))
    want = naive.decode_attention(q, *parts, *residual, bits, group, d**-0.5)
    for split_len in (64, 1024):  # several splits of the history, or one
        got = triton_quant.decode_attention(q, *parts, *residual, bits, group, d**-0.5, split_len=split_len)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU path is tested above")
def test_kernels_on_gpu_match_the_reference():
    parts, residual = packed_history(1, 2, 256, 16, 128, 4, 64)
    q = torch.randn(1, 8, 128)
    want = naive.decode_attention(q, *parts, *residual, 4, 64, 128**-0.5)
    got = triton_quant.decode_attention(
        q.cuda(), *[p.cuda() for p in parts], *[r.cuda() for r in residual], 4, 64, 128**-0.5
    )
    torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)
