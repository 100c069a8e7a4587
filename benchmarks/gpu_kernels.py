"""Time the quantized-KV Triton kernels on a CUDA GPU and report achieved bandwidth against the GPU's peak.

    bash benchmarks/gpu_kernels.sh [--tokens 32768] [--kv-heads 8] [--q-heads 32] [--head-dim 128] [--bits 4]

Shapes default to a long-context layer of an 8B-class model: 32k tokens x 8 KV heads x 128 dims, bf16 input.
Bandwidth = bytes the kernel must read and write (inputs and outputs, each once) / median time
(triton.testing.do_bench).
"""

from __future__ import annotations

import argparse
import sys

import torch

PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600, "RTX 4090": 1008}


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4, choices=[2, 4, 8])
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--residual", type=int, default=32)
    ap.add_argument("--peak-gbps", type=float, default=None, help="the GPU's peak memory bandwidth, GB/s")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing measured (the CPU path is covered by the tests)", file=sys.stderr)
        return 1
    import triton.testing

    from evalkit import kernels
    from evalkit.kernels import quant

    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in name), None)
    if peak is None:
        print(f"unknown peak bandwidth for {name}: pass --peak-gbps", file=sys.stderr)
        return 2
    t, h, hq, d, bits, group = args.tokens, args.kv_heads, args.q_heads, args.head_dim, args.bits, args.group
    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(h, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn(h, t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    keys_by_channel = keys.transpose(-1, -2).contiguous().view(h * d, t)  # the cache quantizes keys per channel
    values_by_token = values.view(h * t, d)
    print(f"{name}: {t} tokens x {h} KV heads x {d} dims, bf16 -> int{bits} (group {group}); peak {peak:.0f} GB/s")
    rows = []
    inputs = {"quantize keys (per channel)": keys_by_channel, "quantize values (per token)": values_by_token}
    for label, x in inputs.items():
        out = quant.quantize(x, bits, group)
        ms = triton.testing.do_bench(lambda x=x: quant.quantize(x, bits, group))
        rows.append((label, ms, nbytes(x, *out)))
    parts = kernels.quantize_kv(keys[None], values[None], bits, group)  # CUDA tensors: the Triton kernels
    residual = (
        torch.randn(1, h, args.residual, d, device="cuda", dtype=torch.bfloat16, generator=g),
        torch.randn(1, h, args.residual, d, device="cuda", dtype=torch.bfloat16, generator=g),
    )
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ms = triton.testing.do_bench(lambda: quant.decode_attention(q, *parts, *residual, bits, group, d**-0.5))
    rows.append(("decode attention (1 query token)", ms, nbytes(q, *parts, *residual)))
    dense = torch.nn.functional.scaled_dot_product_attention
    kd, vd = keys[None].repeat_interleave(hq // h, 1), values[None].repeat_interleave(hq // h, 1)
    ms_dense = triton.testing.do_bench(lambda: dense(q[:, :, None], kd, vd))
    print(f"{'kernel':<36} {'ms':>8} {'MB moved':>9} {'GB/s':>8} {'of peak':>8}")
    for label, ms, moved in rows:
        gbps = moved / ms / 1e6
        print(f"{label:<36} {ms:>8.3f} {moved / 1e6:>9.1f} {gbps:>8.0f} {gbps / peak:>7.0%}")
    print(f"{'(bf16 SDPA over the same history)':<36} {ms_dense:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
