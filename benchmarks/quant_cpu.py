"""Throughput of the quantized-KV reference path on the CPU: quantize, dequantize and decode attention.

Run it without TRITON_INTERPRET, so the CPU gets the PyTorch references.

    python benchmarks/quant_cpu.py [--tokens 2048] [--kv-heads 3] [--q-heads 9] [--head-dim 64]

Defaults are SmolLM2's per-layer KV shape at 2k tokens. Also times dense float32 attention over the same
history for contrast; all in one process, interleaved, medians of 5.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from evalkit import kernels


def median_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--group", type=int, default=64)
    args = ap.parse_args()
    t, h, hq, d, group = args.tokens, args.kv_heads, args.q_heads, args.head_dim, args.group
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g)
    q = torch.randn(1, hq, d, generator=g)
    mb = keys.numel() * 4 / 1e6
    print(f"torch threads {torch.get_num_threads()}; {t} tokens x {h} KV heads x {d} dims (float32 {mb:.1f} MB each)")
    print(f"{'bits':>4} {'quantize K+V ms':>16} {'dequantize K+V ms':>18} {'decode attn ms':>15} {'dense attn ms':>14}")
    dense = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q[:, :, None], keys.repeat_interleave(hq // h, 1), values.repeat_interleave(hq // h, 1)
    )
    empty = keys[:, :, :0]  # no residual window
    for bits in (8, 4, 2):

        def quantize(bits=bits):  # the CPU gets the PyTorch references (unless TRITON_INTERPRET=1)
            return kernels.quantize_kv(keys, values, bits, group)

        parts = quantize()

        def dequantize(bits=bits, parts=parts):
            return (
                kernels.dequantize(*(p.flatten(0, 2) for p in parts[:3]), bits, group),
                kernels.dequantize(*(p.flatten(0, 2) for p in parts[3:]), bits, group),
            )

        def attend(parts=parts, bits=bits):  # the packed history, read directly
            return kernels.decode_attention(q, *parts, empty, empty, bits, group, d**-0.5)

        print(
            f"{bits:>4} {median_ms(quantize):>16.2f} {median_ms(dequantize):>18.2f} {median_ms(attend):>15.2f} "
            f"{median_ms(dense):>14.2f}"
        )


if __name__ == "__main__":
    main()
