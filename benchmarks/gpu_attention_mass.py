"""On a CUDA GPU: the fused attention-plus-mass Triton kernel (kernels/attention_mass.py) against SDPA alone, for
H2O's prefill. Not run yet: no GPU was at hand when it was written; the kernel is tested against its
reference under TRITON_INTERPRET=1 on the CPU (tests/test_attention_mass_kernel.py).

    python benchmarks/gpu_attention_mass.py [--tokens 8192 32768] [--q-heads 32] [--kv-heads 8] [--head-dim 128]
        [--dtype bfloat16]

Per length: the kernel's output and mass against the plain reference at a small size first (a wrong kernel is not
timed), then the median time (triton.testing.do_bench) of the kernel, of PyTorch's SDPA (causal, the flash backend)
and of SDPA plus evalkit's chunked second pass (what the CPU path replaced); the goal is the kernel within 1.10x of
SDPA alone, the mass then nearly free.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton.testing

from evalkit.attention.fused import attention_mass
from evalkit.kernels import naive
from evalkit.kernels.attention_mass import attention_with_mass


def timings(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> tuple[float, float, float]:
    """Median milliseconds at t tokens: SDPA alone, the fused kernel, SDPA plus the chunked second pass."""
    q = torch.randn(1, hq, t, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, hkv, t, d, device="cuda", dtype=dtype) for _ in range(2))

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return (
        triton.testing.do_bench(sdpa),
        triton.testing.do_bench(lambda: attention_with_mass(q, k, v, d**-0.5)),
        triton.testing.do_bench(lambda: (sdpa(), attention_mass(q, k, d**-0.5))),
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    small = [torch.randn(1, h, 300, d, device="cuda") for h in (hq, hkv, hkv)]
    want = naive.attention_with_mass(*small, d**-0.5)
    got = attention_with_mass(*small, d**-0.5)
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[1], want[1], rtol=1e-3, atol=1e-2)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, Hq {hq}, Hkv {hkv}, D {d}; kernel checked at 300 tokens")
    print(f"{'tokens':>7} {'SDPA ms':>9} {'kernel ms':>10} {'ratio':>6} {'SDPA + 2nd pass ms':>19}")
    for t in args.tokens:
        sdpa, fused, two = timings(t, hq, hkv, d, dtype)
        print(f"{t:>7} {sdpa:>9.2f} {fused:>10.2f} {fused / sdpa:>5.2f}x {two:>19.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
