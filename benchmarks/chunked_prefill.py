"""Chunked vs one-shot prefill on SmolLM2: peak KV bytes and peak process memory, and the decode quality of both.

    python benchmarks/chunked_prefill.py [--length 8192] [--budget 1024] [--chunk 512]

For streaming_llm and h2o at a budget of `budget` tokens, each (policy, prefill) pair runs in its own fresh process:
the model loads, the peak resident memory (VmHWM) is reset, then the context goes in one shot (the full cache, then
compression) or in chunks (compression after every chunk). Reported: the most KV bytes held (measured from the
tensors), the bound budget + chunk tokens' worth, and the peak process memory above the loaded model.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from eviction_cost import context_ids, load, policies, rss_mb  # noqa: E402

from evalkit.engine.engine import chunked_prefill, prefill
from evalkit.kv.cache import compress, held_per_layer, kv_bytes


def child(policy: str, mode: str, length: int, budget: int, chunk: int) -> None:
    loaded = load()
    ids = context_ids(loaded, length)
    (pol,) = policies([f"{policy}@{budget}"])
    prefill(loaded.model, ids[:, :chunk])  # warm-up
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM): loading the model is not measured
        f.write("5")
    before = rss_mb("VmRSS")
    t = time.perf_counter()
    if mode == "oneshot":
        full, obs = prefill(loaded.model, ids, [pol])
        peak_kv = kv_bytes(full)
        cache = compress(full, pol, obs)
        del full, obs
    else:
        cache, peak_kv, _ = chunked_prefill(loaded.model, ids, pol, chunk)
    seconds = time.perf_counter() - t
    per_token = sum(
        2 * layer.keys.shape[1] * layer.keys.shape[-1] * layer.keys.element_size() for layer in cache.layers
    )
    print(
        json.dumps(
            {
                "policy": policy,
                "mode": mode,
                "tokens": int(ids.shape[1]),
                "peak_kv_bytes": peak_kv,
                "bound_bytes": (budget + chunk) * per_token,
                "held_after": max(held_per_layer(cache)),
                "rss_above_start_mb": rss_mb("VmHWM") - before,
                "seconds": seconds,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--child", nargs=2, metavar=("POLICY", "MODE"))
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.length, args.budget, args.chunk)
        return
    print(
        f"{'policy':<14} {'prefill':<9} {'tokens':>7} {'peak KV MiB':>11} {'bound MiB':>9} {'within':>7} "
        f"{'held after':>11} {'peak RSS above start MiB':>24} {'prefill s':>10}"
    )
    for policy in ("streaming_llm", "h2o"):
        for mode in ("oneshot", "chunked"):
            cmd = [sys.executable, __file__, "--child", policy, mode]
            cmd += ["--length", str(args.length), "--budget", str(args.budget), "--chunk", str(args.chunk)]
            r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            within = "yes" if r["peak_kv_bytes"] <= r["bound_bytes"] else "no"
            print(
                f"{policy:<14} {mode:<9} {r['tokens']:>7} {r['peak_kv_bytes'] / 2**20:>11.1f} "
                f"{r['bound_bytes'] / 2**20:>9.1f} {within:>7} {r['held_after']:>11} "
                f"{r['rss_above_start_mb']:>24.0f} {r['seconds']:>10.1f}"
            )


if __name__ == "__main__":
    main()
