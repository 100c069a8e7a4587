"""Seconds per sample of quantized runs vs the full-cache run on SmolLM2 on the CPU.

    python benchmarks/quant_speed.py [--length 2048] [--samples 3] [--tokens 16] [--packed]

Each sample (a needle prompt of about `--length` context tokens) goes through `run_sample` once per storage, in one
process, interleaved sample by sample: `none@1.0` (the full cache) and `none@1.0+int8`, `+int4`, `+fp8` with the
conf/quant defaults; `--packed` adds int8, int4 and fp8 forced onto the packed path (`cpu_path=packed`, what the CPU
ran before the dequantized copy). Every run decodes exactly `--tokens` tokens. Two ratios to the full cache:

- run: the whole `run_sample` (prefill, baseline decode, then the variant), as a run or a gate pays it per sample;
- variant: the variant alone, compression (quantizing) plus decode, the part that differs between storages.

The prefill column shows how much of a run's spread is the shared prefill's own noise.

Run it without TRITON_INTERPRET: the CPU then takes the PyTorch references where a path reads packed storage.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch
from omegaconf import OmegaConf

from evalkit.cli.config import quant_spec
from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.engine.engine import run_sample
from evalkit.kv.variant import Variant
from evalkit.policies.none import FullCache
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt

ROOT = os.path.join(os.path.dirname(__file__), "..")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--packed", action="store_true", help="also time the packed path on the CPU")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter times Triton's emulation, not the CPU path")
    loaded = models.load(model_spec(OmegaConf.load(os.path.join(ROOT, "conf", "model", "smollm2-135m.yaml"))), "cpu")
    specs = {
        n: quant_spec(OmegaConf.load(os.path.join(ROOT, "conf", "quant", f"{n}.yaml"))) for n in ("int8", "int4", "fp8")
    }
    storages = {"full": None, **specs}
    if args.packed:
        storages.update({f"{n} packed": replace(s, cpu_path="packed") for n, s in specs.items()})
    task = NeedleTask(context_lengths=[args.length], depths=[0.5], samples_per_cell=args.samples)
    prompts = [build_prompt(loaded.tokenizer, s) for s in task.samples(loaded.tokenizer)]
    run_sample(loaded.model, prompts[0], [Variant(FullCache(budget=1.0))], 2, set())  # warm-up

    whole: dict[str, list[float]] = {n: [] for n in storages}
    variant: dict[str, list[float]] = {n: [] for n in storages}
    prefill: dict[str, list[float]] = {n: [] for n in storages}
    paths: dict[str, str] = {}
    for i, prompt in enumerate(prompts):
        names = list(storages)
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order between samples
            t = time.perf_counter()
            _, (out,) = run_sample(
                loaded.model, prompt, [Variant(FullCache(budget=1.0), storages[name])], args.tokens, set()
            )
            whole[name].append(time.perf_counter() - t)
            variant[name].append(out.seconds["compress"] + out.seconds["decode"])
            prefill[name].append(out.seconds["prefill"])
            paths[name] = out.attention_path
            assert len(out.tokens) == args.tokens
    n_ctx = [p.n_context for p in prompts]
    print(
        f"SmolLM2-135M on the CPU, torch threads {torch.get_num_threads()}; {len(prompts)} samples of "
        f"{min(n_ctx)}-{max(n_ctx)} context tokens, {args.tokens} decoded tokens; medians"
    )
    print(
        f"{'storage':>12} {'attention path':>18} {'run s':>7} {'run ratio':>10} {'variant s':>10} "
        f"{'variant ratio':>14} {'prefill s':>10}"
    )
    w0, v0 = statistics.median(whole["full"]), statistics.median(variant["full"])
    for name in storages:
        w, v = statistics.median(whole[name]), statistics.median(variant[name])
        p = statistics.median(prefill[name])
        print(f"{name:>12} {paths[name]:>18} {w:>7.2f} {w / w0:>9.2f}x {v:>10.2f} {v / v0:>13.2f}x {p:>10.2f}")


if __name__ == "__main__":
    main()
