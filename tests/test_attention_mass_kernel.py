"""The fused attention-plus-mass Triton kernel (kernels/attention_mass.py) against its plain reference
(kernels/naive.py) and evalkit's CPU path (evalkit.attention.fused), under TRITON_INTERPRET=1 on the CPU at small sizes;
on a CUDA machine the last test runs it on the GPU."""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.attention.fused import attend_with_mass
from evalkit.kernels import naive

kernel = pytest.importorskip("evalkit.kernels.attention_mass", reason="triton is not installed")

# (B, Hq, Hkv, Tq, Tk, D, block): odd lengths that leave partial blocks, a past before the queries, one decode
# step, a head dim below the block's 16, grouped query heads and plain multi-head
CASES = [
    (1, 4, 2, 37, 37, 16, 16),
    (2, 6, 2, 5, 40, 32, 16),
    (1, 2, 1, 1, 23, 8, 16),
    (1, 3, 3, 20, 33, 16, 32),
]


def inputs(b, hq, hkv, tq, tk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, tq, d, generator=g),
        torch.randn(b, hkv, tk, d, generator=g) * 2,
        torch.randn(b, hkv, tk, d, generator=g),
    )


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "tq", "tk", "d", "block"),
    CASES,
    ids=[f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-Tq{c[3]}-Tk{c[4]}-D{c[5]}-blk{c[6]}" for c in CASES],
)
def test_kernel_output_and_mass_equal_the_reference(b, hq, hkv, tq, tk, d, block):
    """The output (B, Tq, Hq, D) and the mass (B, Hkv, Tk) of the kernel equal the materialised softmax's, and the
    CPU path's; each query of each head gives out exactly 1 in all. Catches a causal bound off by one at block edges,
    the second pass normalised by the wrong log-sum-exp, mass added to the wrong KV head, rows past Tq leaking."""
    q, k, v = inputs(b, hq, hkv, tq, tk, d)
    want_out, want_mass = naive.attention_with_mass(q, k, v, d**-0.5)
    out, mass = kernel.attention_with_mass(q, k, v, d**-0.5, block_m=block, block_n=block)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mass, want_mass, rtol=1e-4, atol=1e-5)
    cpu_out, cpu_mass = attend_with_mass(q, k, v, d**-0.5)
    torch.testing.assert_close(cpu_out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cpu_mass, want_mass, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass.sum(), torch.tensor(float(b * hq * tq)), rtol=1e-5, atol=1e-3)


def test_reference_by_hand():
    """One head, 1-d keys [ln 3, 0] and values [1, 3]; queries 1 (the last two keys, causal), scale 1: query 0 sees
    key 0 only -> p = [1, 0], output 1; query 1 sees both -> p = [3/4, 1/4], output 3/4 + 3/4 = 3/2. Mass: key 0
    1 + 3/4, key 1 1/4."""
    q = torch.ones(1, 1, 2, 1)
    k = torch.tensor([math.log(3), 0.0]).view(1, 1, 2, 1)
    v = torch.tensor([1.0, 3.0]).view(1, 1, 2, 1)
    out, mass = naive.attention_with_mass(q, k, v, 1.0)
    torch.testing.assert_close(out.flatten(), torch.tensor([1.0, 1.5]))
    torch.testing.assert_close(mass.flatten(), torch.tensor([1.75, 0.25]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the kernel runs interpreted above")
def test_kernel_on_gpu_matches_the_reference():
    q, k, v = inputs(1, 8, 2, 300, 300, 128)
    want_out, want_mass = naive.attention_with_mass(q, k, v, 128**-0.5)
    out, mass = kernel.attention_with_mass(q.cuda(), k.cuda(), v.cuda(), 128**-0.5)
    torch.testing.assert_close(out.cpu(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mass.cpu(), want_mass, rtol=1e-4, atol=1e-3)
