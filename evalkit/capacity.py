"""Sequences that fit: free memory after the weights, divided by the bytes a sequence's KV cache takes. The gate's
capacity line and the planner share it."""

from __future__ import annotations

from typing import Any

from evalkit.units import GiB


def free_bytes(gpu_gib: float, weights_bytes: float, utilization: float = 1.0) -> float:
    """Accelerator bytes left for KV: the usable share of the memory, less the weights."""
    return gpu_gib * GiB * utilization - weights_bytes


def sequences(free: float, per_sequence: float, shared: float = 0.0) -> int:
    """How many sequences of `per_sequence` KV bytes fit in `free` bytes; with prefix caching a share `shared` of
    every sequence is one prefix held once: shared x per_sequence once, then (1 - shared) x per_sequence each."""
    own = (1 - shared) * per_sequence
    room = free - shared * per_sequence
    return int(room // own) if own > 0 and room > 0 else 0


def capacity(summary: dict[str, Any], weights_bytes: int, gpu_gib: float, context: int) -> dict[str, Any]:
    """The gate's capacity line: how many sequences of `context` tokens fit in `gpu_gib` of accelerator memory after
    the weights, per variant, from the KV bytes per context token of the run as a deployment holds them (fp16/bf16,
    or packed)."""
    free = free_bytes(gpu_gib, weights_bytes)
    out = {}
    for name, s in summary.items():
        per_seq = s["kv_bytes_per_token"] * context
        out[name] = {
            "kv_bytes_per_token": s["kv_bytes_per_token"],
            "kv_bytes_per_sequence": per_seq,
            "sequences": sequences(free, per_seq),
        }
    return out
