"""Compute Expected Attention's query statistics for a model here, offline, from its own queries on evalkit's prose
haystack (the prompts `python -m evalkit.calibrate qfilter` calibrates on).

    python -m evalkit.calibrate ea_stats --model smollm2-135m --out DIR [--lengths 1024] [--depths ...] [--n-sink 4]

Per layer and query head: the mean and covariance (divided by N - 1) of the pre-RoPE queries of every prompt after
its first `n_sink` tokens, pooled, as kvpress's `expected_attention_with_stats.py` computes them over booksum.
Written as kvpress's ExpectedAttentionStats saves them (`model.safetensors` with `query_mean` and `query_cov`, and
the `config.json` its from_pretrained reads), so that evalkit (`policy=expected_attention_stats
policy.weights_path=DIR`) and kvpress (`ExpectedAttentionStatsPress(stats_folder=DIR)`) read the same file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from evalkit.calibrate.common import every_layer, load
from evalkit.engine.engine import prefill
from evalkit.policies.expected_attention import ExpectedAttention, QueryStats


def statistics(model, prompts: list[torch.Tensor], n_sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(layers, Hq, D) mean and (layers, Hq, D, D) covariance / (N - 1) of the pre-RoPE queries after each prompt's
    sinks, pooled over the prompts (each prompt's own mean and covariance, from the prefill's QueryStats)."""
    parts: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for ids in prompts:
        _, obs = prefill(model, ids.to(model.device), [ExpectedAttention(n_sink=n_sink)])
        n = ids.shape[1] - n_sink
        for layer, values in obs.items():
            s = values[QueryStats(n_sink)]
            parts.setdefault(layer, []).append((n, s.mean[0].double(), s.cov[0].double()))
    means, covs = [], []
    for layer in sorted(parts):
        total = sum(n for n, _, _ in parts[layer])
        mean = sum(n * m for n, m, _ in parts[layer]) / total
        scatter = sum(n * c + n * (m - mean)[..., None] * (m - mean)[..., None, :] for n, m, c in parts[layer])
        means.append(mean)
        covs.append(scatter / (total - 1))
    return torch.stack(means).float(), torch.stack(covs).float()


def main(args: argparse.Namespace) -> None:
    loaded, prompts = load(args)
    mean, cov = statistics(loaded.model, prompts, args.n_sink)
    every_layer(mean.shape[0], loaded.model, "Expected Attention's statistics")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"query_mean": mean.contiguous(), "query_cov": cov.contiguous()}, str(out / "model.safetensors"))
    layers, heads, dim = mean.shape
    config = {"num_layers": layers, "num_heads": heads, "head_dim": dim, "n_sink": args.n_sink}
    config |= {"dataset_name": "evalkit prose haystack", "model_name": args.model}
    config |= {"num_samples": len(prompts), "sample_seq_len": max(p.shape[1] for p in prompts)}
    (out / "config.json").write_text(json.dumps(config))
    print(f"wrote {out} ({layers} layers x {heads} query heads x {dim}, {len(prompts)} prompts)")
