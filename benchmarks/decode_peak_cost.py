"""What counting the decoded-from cache's deployed bytes costs a decode step: `deployed_bytes` on a cache of a model's
shape, against one step's attention over the same cache.

    python benchmarks/decode_peak_cost.py [--layers 30 --kv-heads 3 --q-heads 9 --head-dim 64] [--lengths 4096 32768]

Every decode step counts the bytes its cache holds as deployed (evalkit.engine.decode.Decoded.saw), before any
eviction. A dense layer's bytes depend on the key channels each head stores (ThinK's pruned channels are not), which
a scan of every key reads; the newest token alone tells when it stores every channel (evalkit.kv.cache
._stored_channels). Printed per length, in milliseconds (median of --repeats, one torch thread): the count as the
decode makes it (`newest token`), the full scan it replaces where every channel is stored (`scan`), and one decode
step's attention of one query over the cache (SDPA, grouped query heads), the work the count rides on. The defaults
are SmolLM2-135M's shape. Compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.cache_utils import DynamicCache

from evalkit.kv.cache import deployed_bytes


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def scan(cache: DynamicCache) -> None:
    """The key channels each head stores, read off every token (what the count did before the newest-token test)."""
    for layer in cache.layers:
        (layer.keys != 0).any(dim=2).sum(-1)


def attention(cache: DynamicCache, query: torch.Tensor) -> None:
    """One decode step's attention: one query per head over every layer's cache."""
    for layer in cache.layers:
        torch.nn.functional.scaled_dot_product_attention(query, layer.keys, layer.values, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'tokens':>8} {'newest token ms':>16} {'scan ms':>10} {'attention ms':>13} {'count / attention':>18}")
    for length in args.lengths:
        cache = DynamicCache()
        shape = (1, args.kv_heads, length, args.head_dim)
        for layer in range(args.layers):
            cache.update(torch.randn(shape), torch.randn(shape), layer)
        query = torch.randn(1, args.q_heads, 1, args.head_dim)
        count = timed(lambda c=cache: deployed_bytes(c), args.repeats)
        full = timed(lambda c=cache: scan(c), args.repeats)
        attend = timed(lambda c=cache, q=query: attention(c, q), args.repeats)
        print(f"{length:>8} {count:>16.2f} {full:>10.1f} {attend:>13.1f} {count / attend:>18.3f}")


if __name__ == "__main__":
    main()
