"""Train Fast KVzip gates for a model here, offline: a stand-in for the published gates, not the paper's training.

    python -m evalkit.calibrate fastkvzip --model smollm2-135m --out fastkvzip/smollm2.pt [--lengths 1024]
        [--depths ...] [--steps 300]

For each calibration prompt: evalkit's KVzip scores of every context token (the reconstruction pass, chunks of 2048,
4 sinks) and the hidden states entering each layer's attention (KVzap's HiddenStates). Per layer, a gate of the
published architecture (policies/fastkvzip.gate_scores: 16-dim queries and keys, 16 sink keys) is fitted by Adam to
the scores (mean squared error, the 4 sinks left out), from a seeded start. Written as the authors publish gates, a
torch file {"module": [one state dict per layer]}, so that evalkit (`policy=fastkvzip policy.weights_path=OUT`) and
kvpress (FastKVzipGate.load_state_dict) read the same file. Prints each layer's R^2 on the calibration tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from evalkit.calibrate.common import every_layer, load, scores_and_hidden
from evalkit.policies.fastkvzip import gate_scores

SINKS, CHUNK, DIM, GATE_SINKS, LR = 4, 2048, 16, 16, 3e-3


def initial(n_kv: int, n_q: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """A gate's seeded starting point (Gaussian projections and sink keys, unit norms, zero biases): with --steps 0,
    the gates written; the peer check (benchmarks/peer_kvpress.py, tests/test_peer_kvpress.py) uses these for SmolLM2,
    the same file on both sides, where a trained file would be 13 MB."""
    g = torch.Generator().manual_seed(seed)
    return {
        "q_proj.weight": torch.randn(n_q * DIM, hidden, generator=g) / hidden**0.5,
        "q_proj.bias": torch.zeros(n_q * DIM),
        "k_proj.weight": torch.randn(n_kv * DIM, hidden, generator=g) / hidden**0.5,
        "q_norm.weight": torch.ones(DIM),
        "k_norm.weight": torch.ones(DIM),
        "k_base": torch.randn(n_kv, 1, GATE_SINKS, DIM, generator=g) / DIM**0.5,
        "b": torch.zeros(n_kv, 1, n_q // n_kv),
    }


def initial_gates(config, path: Path) -> Path:
    """Write every layer's seeded starting gate (seed = the layer) for a text `config` to `path`, untrained."""
    n_kv, n_q, hidden = config.num_key_value_heads, config.num_attention_heads, config.hidden_size
    torch.save({"module": [initial(n_kv, n_q, hidden, i) for i in range(config.num_hidden_layers)]}, path)
    return path


def fit(x: torch.Tensor, y: torch.Tensor, n_q: int, steps: int, seed: int) -> tuple[dict[str, torch.Tensor], float]:
    """A gate fitted to scores y (1, Hkv, N) from hidden states x (1, N, hidden), and its R^2."""
    gate = initial(y.shape[1], n_q, x.shape[-1], seed)
    for t in gate.values():
        t.requires_grad_(True)
    opt = torch.optim.Adam(gate.values(), lr=LR)
    x = x.float()
    for _ in range(steps):
        opt.zero_grad()
        loss = (gate_scores(gate, x) - y).pow(2).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        r2 = 1 - float((gate_scores(gate, x) - y).pow(2).sum() / (y - y.mean()).pow(2).sum())
    return {k: v.detach().contiguous() for k, v in gate.items()}, r2


def main(args: argparse.Namespace) -> None:
    loaded, prompts = load(args)
    cfg = loaded.model.config.get_text_config()
    data = scores_and_hidden(loaded.model, prompts, SINKS, CHUNK, plus=False)
    every_layer(len(data), loaded.model, "Fast KVzip")
    gates, r2s = [], []
    with torch.inference_mode(False), torch.enable_grad():
        for layer, (x, y) in data.items():
            gate, r2 = fit(x.clone(), y.clone(), cfg.num_attention_heads, args.steps, seed=layer)
            gates.append(gate)
            r2s.append(r2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": gates}, out)
    print("R^2 per layer:", " ".join(f"{r:.2f}" for r in r2s))
    print(f"wrote {out} ({cfg.num_hidden_layers} gates, {cfg.hidden_size} -> {DIM}-dim, {GATE_SINKS} sink keys)")
