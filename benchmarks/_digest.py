"""Digests of what a cache holds, computed alike on both sides of benchmarks/peer_kvpress.py (kvpress's, in its own
venv, and evalkit's) and in tests/test_peer_kvpress.py: torch only.

For a method that rewrites what it keeps (re-rotated keys, merged values, pruned key channels) the kept positions
are not enough: five sums per KV head stand for the held tensors, and the key channels zero in every held token.
"""

from __future__ import annotations

import torch


def digest(keys: torch.Tensor, values: torch.Tensor, order: list[list[int]]) -> list[list[float]]:
    """Per KV head, five sums over its held tokens taken in position order (rank r = 0, 1, ...): of the keys, of the
    keys times their channel index + 1, of the values, and of the keys and of the values times r + 1. Sums in float64
    of what the press holds: equal up to float32 rounding when the tensors are, in the same order."""
    out = []
    for h, slots in enumerate(order):
        k, v = keys[h, slots].double(), values[h, slots].double()  # (T_held, D) in position order
        channel = torch.arange(1, k.shape[-1] + 1, dtype=torch.float64)
        rank = torch.arange(1, k.shape[0] + 1, dtype=torch.float64)
        sums = [k.sum(), (k * channel).sum(), v.sum(), (k.sum(-1) * rank).sum(), (v.sum(-1) * rank).sum()]
        out.append([round(float(x), 6) for x in sums])
    return out


def pruned(keys: torch.Tensor) -> list[list[int]]:
    """Per KV head, the key channels that are zero in every held token."""
    return [torch.nonzero(~(k != 0).any(dim=0)).flatten().tolist() for k in keys]


def digest_gap(ours: list, theirs: list) -> float:
    """The largest relative difference |a - b| / max(|a|, |b|, 1) between two digests (per layer, per head, the five
    sums), over layers, heads and sums."""
    return max(
        abs(a - b) / max(abs(a), abs(b), 1.0)
        for la, lb in zip(ours, theirs, strict=True)
        for ha, hb in zip(la, lb, strict=True)
        for a, b in zip(ha, hb, strict=True)
    )
