"""Seconds per needle sample on SmolLM2: baseline alone vs baseline + one policy, and model load times.

    python benchmarks/needle_speed.py [--lengths 1024 4096] [--samples 3] [--budget 0.25]

Prints numbers only; BENCHMARKS.md records them. Both modes run interleaved, sample by sample, in one process,
so their ratio is measured under the same machine load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from omegaconf import OmegaConf

from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.engine.engine import run_sample
from evalkit.kv.variant import Variant
from evalkit.policies.streaming_llm import StreamingLLM
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt

CONF = os.path.join(os.path.dirname(__file__), "..", "conf", "model", "smollm2-135m.yaml")


def load_times(cfg) -> tuple[float, float]:
    """Seconds for a first load (GGUF dequantized and cached) and a cached load, in a fresh cache folder."""
    old = os.environ.get("EVALKIT_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EVALKIT_CACHE"] = tmp
        first = models.load(cfg, "cpu").load_seconds
        cached = models.load(cfg, "cpu").load_seconds
    if old is None:
        del os.environ["EVALKIT_CACHE"]
    else:
        os.environ["EVALKIT_CACHE"] = old
    return first, cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.25)
    args = ap.parse_args()
    cfg = model_spec(OmegaConf.load(CONF))
    first, cached = load_times(cfg)
    print(f"model load: first (GGUF -> safetensors) {first:.1f} s, cached {cached:.2f} s")

    loaded = models.load(cfg, "cpu")
    stop = {loaded.tokenizer.eos_token_id}
    variant = Variant(StreamingLLM(budget=args.budget))
    print(f"torch threads {torch.get_num_threads()}; policy {variant.name}; {args.samples} samples per length")
    print(f"{'context':>8} {'baseline s/sample':>18} {'+ policy s/sample':>18} {'ratio':>7} {'prefill s':>10}")
    for length in args.lengths:
        task = NeedleTask(context_lengths=[length], depths=[0.5], samples_per_cell=args.samples)
        alone, both, prefill = [], [], []
        for sample in task.samples(loaded.tokenizer):
            prompt = build_prompt(loaded.tokenizer, sample)
            t = time.perf_counter()
            base, _ = run_sample(loaded.model, prompt, [], task.max_new_tokens, stop)
            alone.append(time.perf_counter() - t)
            t = time.perf_counter()
            run_sample(loaded.model, prompt, [variant], task.max_new_tokens, stop)
            both.append(time.perf_counter() - t)
            prefill.append(base.seconds["prefill"])
        a, b = statistics.median(alone), statistics.median(both)
        print(f"{length:>8} {a:>18.2f} {b:>18.2f} {b / a:>6.2f}x {statistics.median(prefill):>10.2f}")


if __name__ == "__main__":
    main()
