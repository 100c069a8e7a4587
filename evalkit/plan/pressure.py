"""KV pressure (KV bytes against weight bytes read per decode step), the crossover context, and KV offload over a
CPU-GPU link."""

from __future__ import annotations

import math
from typing import Any

from evalkit.arch import Arch, kv_bytes_per_sequence

# One-way bandwidth in GB/s (1e9 bytes): PCIe x16 Gen4 16 GT/s x 16 lanes (31.5 GB/s after 128b/130b coding), Gen5 twice
# that; NVLink-C2C (Grace Hopper) 900 GB/s in both directions together, 450 each way.
LINKS = {"pcie4": 32.0, "pcie5": 64.0, "nvlink-c2c": 450.0}


BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def pressure(arch: Arch, weights_bytes: float, batch: int, context: int, per_element: float = 2.0) -> dict:
    """KV bytes vs weight bytes read per decode step at `batch` sequences of `context` tokens."""
    kv = batch * kv_bytes_per_sequence(arch, context, per_element)
    ratio = kv / weights_bytes if weights_bytes > 0 else math.inf
    return {
        "batch": batch,
        "context": context,
        "kv_bytes": kv,
        "weights_bytes": weights_bytes,
        "ratio": ratio,
        "bound": "KV-bound" if ratio > 1 else "weight-bound",
    }


def crossover_context(arch: Arch, weights_bytes: float, batch: int, per_element: float = 2.0) -> float | None:
    """The context at which `batch` sequences' KV bytes equal the weight bytes (KV per sequence is piecewise linear
    in the context: sliding layers stop growing at their window); None where it never does (every layer sliding)."""
    target = weights_bytes / batch
    per_layer = arch.per_layer_elements * per_element
    full, slid = arch.layers - arch.sliding_layers, arch.sliding_layers
    w = arch.window or 0
    if slid and w and (full + slid) * per_layer * w >= target:
        return target / ((full + slid) * per_layer)
    if full == 0:
        return None
    return (target - slid * per_layer * w) / (full * per_layer)


def link_seconds(nbytes: float, gbps: float) -> float:
    """Seconds to move `nbytes` over a link of `gbps` GB/s (1e9 bytes a second)."""
    return nbytes / (gbps * 1e9)


def offload(kv_step_bytes: float, weights_bytes: float, hbm_gbps: float, link_gbps: float) -> dict[str, Any]:
    """KV offloaded to CPU memory, fetched over the link each decode step. The step computes in the time its reads
    take from GPU memory (weights and KV, memory-bound decode); the link must bring the cold KV in that time to hide
    it. Returns the read rate needed to stream all the KV, the step times, and the largest cold share hidden."""
    compute = link_seconds(weights_bytes + kv_step_bytes, hbm_gbps)
    on_link = link_seconds(kv_step_bytes, link_gbps)
    needed = kv_step_bytes / compute / 1e9 if compute > 0 else 0.0
    cold = min(1.0, compute * link_gbps * 1e9 / kv_step_bytes) if kv_step_bytes > 0 else 1.0
    if cold >= 1:
        verdict = (
            f"viable: the whole KV streams over the link within the step ({on_link * 1e3:.1f} ms <= "
            f"{compute * 1e3:.1f} ms)"
        )
    elif cold >= 0.1:
        verdict = (
            f"partly: at most {cold:.0%} of the KV can live in CPU memory without slowing the step; all of it would "
            f"make the step {on_link / compute:.1f}x slower"
        )
    else:
        verdict = (
            f"not viable: the link hides only {cold:.1%} of the KV; offloading all of it makes each step "
            f"{on_link / compute:.0f}x slower ({on_link * 1e3:.0f} ms vs {compute * 1e3:.1f} ms)"
        )
    return {
        "kv_step_bytes": kv_step_bytes,
        "link_gbps": link_gbps,
        "hbm_gbps": hbm_gbps,
        "compute_seconds": compute,
        "link_seconds": on_link,
        "step_seconds_all_offloaded": max(compute, on_link),
        "needed_gbps": needed,
        "cold_fraction": cold,
        "verdict": verdict,
    }
