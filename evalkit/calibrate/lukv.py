"""A budget curve for LU-KV (policy=lukv) computed here, offline: evalkit's stand-in calibration, not LU-KV's own.

    python -m evalkit.calibrate lukv --model smollm2-135m --out curve.npy [--lengths 1024] [--depths 0.1 0.9]

LU-KV's curves come from a global combinatorial optimisation of each head's future utility over a corpus (its
repository's generate_curve.sh). This tool takes a simpler rule with the same shape and meaning: on evalkit's prose
prompts (those of `python -m evalkit.calibrate qfilter`), the inner scorer's scores (Expected Attention, epsilon
0.02; the first 4 and the last token first) of every layer and KV head are ranked together, and for each prune ratio
of 1% to 99% the share of its tokens each head loses when the top (1 - ratio) of all of them are kept, averaged over
the prompts. Each row then keeps at most 1 - its ratio on average, as policy=lukv requires. Written as LU-KV writes its
curves (numpy, (99, layers, KV heads), float32), for evalkit and kvpress's LUKVPress alike.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

from evalkit.calibrate.common import load
from evalkit.engine.engine import prefill
from evalkit.policies import LayerView
from evalkit.policies.expected_attention import ExpectedAttention

SINK, WINDOW = 4, 1


def pruned_shares(model, ids: torch.Tensor, scorer: ExpectedAttention) -> torch.Tensor:
    """(99, layers, KV heads): the share of its tokens each head loses when the top (1 - r) of all the layers' and
    heads' scored tokens are kept together, for r = 1% .. 99%."""
    cache, obs = prefill(model, ids, [scorer])
    n_layers, t = len(cache.layers), ids.shape[1]
    scores = []
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        positions = torch.arange(t, device=keys.device).expand(*keys.shape[:3])
        view = LayerView(i, n_layers, t, keys, values, positions, {}, obs.get(i, {}))
        protected = (positions < max(SINK, scorer.n_sink)) | (positions >= t - WINDOW)
        scores.append(scorer.score(view)[0].masked_fill(protected[0], math.inf))
    flat = torch.stack(scores)  # (L, Hkv, T)
    rank = torch.empty_like(flat, dtype=torch.long).view(-1)
    rank[flat.view(-1).argsort(descending=True, stable=True)] = torch.arange(flat.numel())
    rank = rank.view(flat.shape)
    keep = torch.tensor([int((1 - r / 100) * flat.numel()) for r in range(1, 100)])
    kept = (rank[None] < keep[:, None, None, None]).sum(dim=-1)  # (99, L, Hkv)
    return 1 - kept.double() / t


def main(args: argparse.Namespace) -> None:
    loaded, prompts = load(args)
    scorer = ExpectedAttention(epsilon=0.02)
    curve = sum(pruned_shares(loaded.model, ids, scorer) for ids in prompts) / len(prompts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, curve.numpy().astype(np.float32))
    print(f"wrote {out} {tuple(curve.shape)} from {len(prompts)} prompts")
