"""Fit linear KVzap surrogates for a model here, offline: a stand-in for the published ones, not KVzap's training.

    python -m evalkit.calibrate kvzap --model smollm2-135m --out kvzap/smollm2 [--lengths 1024] [--depths ...]

For each calibration prompt: evalkit's KVzip+ scores of every context token (the reconstruction pass, chunks of
2048, 4 sinks; the prompt's raw ids reconstructed, no repeat instruction) and the hidden states entering each
layer's attention (policies/kvzap.HiddenStates). Per layer, a least-squares linear map (a small ridge, 1e-3 x the
mean squared hidden state) from the hidden state to the log of each KV head's score (scores floored at 1e-6); the
4 sinks, which KVzip keeps whatever they score, are left out of the fit. Written as kvpress's KVzapModel saves a
linear model (`config.json`: input_dim, output_dim, n_modules, hidden_dim null; `model.safetensors`:
`layers.<i>.weight` (KV heads, hidden) and `layers.<i>.bias`), so that evalkit (`policy=kvzap
policy.weights_path=OUT`) and kvpress (`KVzapModel.from_pretrained(OUT)`) read the same folder. Prints each layer's
R^2 on the calibration tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from evalkit.calibrate.common import every_layer, load, scores_and_hidden

SINKS, CHUNK, FLOOR, RIDGE = 4, 2048, 1e-6, 1e-3


def pairs(model, prompts: list[torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: the hidden states (N, hidden) and the log scores (N, Hkv) of every context token after the sinks."""
    data = scores_and_hidden(model, prompts, SINKS, CHUNK, plus=True)
    return {layer: (x[0].double(), y[0].double().clamp_min(FLOOR).log().T) for layer, (x, y) in data.items()}


def fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Ridge least squares y ~ x W^T + b: W (Hkv, hidden), b (Hkv), and the R^2 over all heads."""
    mean_x, mean_y = x.mean(dim=0), y.mean(dim=0)
    xc, yc = x - mean_x, y - mean_y
    gram = xc.T @ xc
    gram += RIDGE * float((xc**2).mean()) * len(x) * torch.eye(gram.shape[0], dtype=gram.dtype)
    w = torch.linalg.solve(gram, xc.T @ yc).T  # (Hkv, hidden)
    b = mean_y - w @ mean_x
    r2 = 1 - float(((yc - xc @ w.T) ** 2).sum() / (yc**2).sum())
    return w.float(), b.float(), r2


def main(args: argparse.Namespace) -> None:
    loaded, prompts = load(args)
    cfg = loaded.model.config.get_text_config()
    data = pairs(loaded.model, prompts)
    every_layer(len(data), loaded.model, "KVzap")
    tensors, r2s = {}, []
    for layer, (x, y) in data.items():
        w, b, r2 = fit(x, y)
        tensors[f"layers.{layer}.weight"], tensors[f"layers.{layer}.bias"] = w.contiguous(), b.contiguous()
        r2s.append(r2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    spec = {"model_type": "kvzap", "input_dim": cfg.hidden_size, "output_dim": cfg.num_key_value_heads}
    spec |= {"n_modules": cfg.num_hidden_layers, "hidden_dim": None, "architectures": ["KVzapModel"]}
    (out / "config.json").write_text(json.dumps(spec, indent=2) + "\n")
    print("R^2 per layer:", " ".join(f"{r:.2f}" for r in r2s))
    print(f"wrote {out} ({cfg.num_hidden_layers} linear surrogates, {cfg.hidden_size} -> {cfg.num_key_value_heads})")
