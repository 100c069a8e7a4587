"""Calibrate Q-Filters for a model here, offline, from its own queries on evalkit's prose haystack.

    python -m evalkit.calibrate qfilter --model smollm2-135m --out qfilters/smollm2 [--lengths 1024] [--depths ...]

For each layer and KV head: the queries of its query heads (post-RoPE, as the attention sees them) over the
calibration prompts, the first right singular vector of that matrix (the top eigenvector of Q^T Q), signed so that
the queries' mean projection on it is negative (Godey et al. 2025, arXiv:2503.02812). Written as kvpress's QFilters
saves them (`model.safetensors` with `q_filters` (layers, KV heads, head dim), and `config.json`), so that evalkit
(`policy=qfilter policy.weights_path=OUT`) and kvpress (`QFilters.from_pretrained(OUT)`) read the same file.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from evalkit.attention.observation import Attended, Observation
from evalkit.calibrate.common import every_layer, load
from evalkit.engine.engine import prefill
from evalkit.policies import KVPolicy


@dataclass(frozen=True)
class QueryMoments(Observation):
    """Per layer: the sum of the post-RoPE queries (B, Hq, D) and of their outer products (B, Hq, D, D)."""

    def prefill(self, at: Attended) -> tuple[torch.Tensor, torch.Tensor]:
        q = at.query.double()
        return q.sum(dim=2), q.transpose(-1, -2) @ q


@dataclass(kw_only=True)
class Calibration(KVPolicy):
    """Not a policy to run: what the prefill records for the calibration."""

    name: str = "qfilter_calibration"

    def needs(self) -> tuple[QueryMoments]:
        return (QueryMoments(),)


def filters(moments: dict[int, tuple[torch.Tensor, torch.Tensor]], n_kv: int) -> torch.Tensor:
    """(layers, Hkv, D) float32: per layer and KV head, the top eigenvector of its query heads' summed outer products,
    its sign making their summed projection negative."""
    out = []
    for layer in sorted(moments):
        total, gram = moments[layer]  # (Hq, D), (Hq, D, D)
        hq, d = total.shape
        group = hq // n_kv
        heads = []
        for g in range(n_kv):
            _, vectors = torch.linalg.eigh(gram[g * group : (g + 1) * group].sum(dim=0))
            u = vectors[:, -1]
            heads.append(-u if float(total[g * group : (g + 1) * group].sum(dim=0) @ u) > 0 else u)
        out.append(torch.stack(heads))
    return torch.stack(out).float()


def calibrate(model, prompts: list[torch.Tensor]) -> torch.Tensor:
    sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for ids in prompts:
        _, obs = prefill(model, ids.to(model.device), [Calibration()])
        for layer, values in obs.items():
            total, gram = values[QueryMoments()]
            if layer in sums:
                total, gram = sums[layer][0] + total[0], sums[layer][1] + gram[0]
            else:
                total, gram = total[0], gram[0]
            sums[layer] = (total, gram)
    every_layer(len(sums), model, "Q-Filters")
    return filters(sums, model.config.get_text_config().num_key_value_heads)


def main(args: argparse.Namespace) -> None:
    loaded, prompts = load(args)
    q = calibrate(loaded.model, prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"q_filters": q.contiguous()}, str(out / "model.safetensors"))
    layers, heads, dim = q.shape
    (out / "config.json").write_text(json.dumps({"num_layers": layers, "num_kv_heads": heads, "kv_head_dim": dim}))
    print(f"wrote {out} ({layers} layers x {heads} KV heads x {dim})")
