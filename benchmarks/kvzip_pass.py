"""KVzip's reconstruction pass against the prefill, as evalkit runs it now and as it ran before, per sample (SmolLM2).

    python benchmarks/kvzip_pass.py [--lengths 1024 2048 4096] [--depths 0 0.5 1] [--threads 1] [--clock cpu]

Per needle sample, interleaved: a plain prefill of the context (what every run pays), the pass now
(`evalkit.policies.kvzip_pass.reconstruct`: every chunk's pass one block of a single forward, the cache layers attending
for the model and scoring from the same logits, the prefilled cache read in place), and the pass as it was before it
became one forward (`legacy_reconstruct` below, kept only to measure against: one forward per chunk over its own copy of
the full cache through SDPA with a mask, scored by a second QK^T over the sinks, the chunk and the pass's own keys).
Both passes must give the same scores (checked on every sample). `--clock cpu` (the default) times the process's CPU
seconds, which other jobs on a shared machine barely move when torch runs one thread; `--clock wall` times wall seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from evalkit.attention.sdpa import causal_tail_mask, observe
from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.engine.engine import prefill
from evalkit.kv.cache import full_attention_layers, share
from evalkit.policies.kvzip_pass import PREVIOUS_IDS, reconstruct
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import Repeat, build_prompt

CONF = os.path.join(os.path.dirname(__file__), "..", "conf", "model", "smollm2-135m.yaml")


@dataclass
class LegacyObserver:
    """The scoring of the former pass: per full-attention layer, the chunk's keys' most attention from any
    query of the pass and any query head of the group, softmax over sinks + chunk + own keys, recomputed from the
    post-RoPE queries and keys in 64-query chunks beside SDPA's own attention."""

    sinks: int
    start: int
    end: int
    scores: dict[int, torch.Tensor]

    def wants_mass(self, layer_idx: int, layer) -> bool:
        return False

    def record(self, layer_idx: int, layer, at) -> None:
        if getattr(layer, "is_sliding", False):
            return
        query, key, scaling = at.query, at.key, at.scaling
        tq, s = query.shape[-2], self.sinks
        keys = torch.cat([key[:, :, :s], key[:, :, self.start : self.end], key[:, :, -tq:]], dim=2)
        b, hq, _, d = query.shape
        hkv, tk = keys.shape[1], keys.shape[2]
        group, past = hq // hkv, tk - tq
        q = query.view(b, hkv, group, tq, d)
        keys_t = keys.float().transpose(-1, -2)
        best = torch.zeros(b, hkv, self.end - self.start)
        for start in range(0, tq, 64):
            end = min(start + 64, tq)
            rows = (q[:, :, :, start:end].float() * scaling).reshape(b, hkv, group * (end - start), d)
            scores = rows @ keys_t[..., : past + end]
            visible = causal_tail_mask(end - start, past + end, query.device)[0, 0].repeat(group, 1)
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            best = torch.maximum(best, probs[..., s : s + self.end - self.start].amax(dim=2))
        held = self.scores[layer_idx][..., self.start : self.end]
        self.scores[layer_idx][..., self.start : self.end] = torch.maximum(held, best)


@torch.inference_mode()
def legacy_reconstruct(model, full, context: torch.Tensor, repeat: Repeat, sinks: int, chunk: int) -> dict:
    """The former pass: one forward per chunk, each over its own `share` of the full cache."""
    n = context.shape[1]
    scores = {i: torch.zeros(1, full.layers[i].keys.shape[1], n) for i in full_attention_layers(full)}
    spans = [(lo, min(lo + chunk, n)) for lo in range(repeat.start, n, chunk)]
    for i, (lo, hi) in enumerate(spans):
        quote = context[0, max(spans[i - 1][0], lo - PREVIOUS_IDS) : lo].tolist() if i else []
        head = (repeat.part + quote if i else repeat.first) + repeat.suffix
        ids = torch.cat([torch.tensor([head]), context[:, lo:hi]], dim=1)
        cache = share(full)  # grows by the pass's tokens: a copy of every layer's keys and values per chunk
        watch = observe(LegacyObserver(min(sinks, lo), lo, hi, scores), cache)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **watch)
    return scores


def clock(kind: str):
    return time.process_time if kind == "cpu" else time.perf_counter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--chunk", type=int, default=2048, help="context tokens per pass (KVzip's chunk_size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tick = clock(args.clock)
    loaded = models.load(model_spec(OmegaConf.load(CONF)), "cpu")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} seconds; chunks of {args.chunk} tokens")
    print(f"{'sample':>14} {'tokens':>6} {'prefill':>8} {'pass now':>9} {'ratio':>6} {'pass before':>12} {'ratio':>6}")
    now, before = [], []
    for length in args.lengths:
        task = NeedleTask(context_lengths=[length], depths=list(args.depths))
        for sample in task.samples(loaded.tokenizer):
            prompt = build_prompt(loaded.tokenizer, sample)
            context = prompt.ids[:, : prompt.n_context]
            t = tick()
            full, _ = prefill(loaded.model, context)
            p = tick() - t
            t = tick()
            got = reconstruct(loaded.model, full, context, prompt.repeat, 4, args.chunk)
            a = tick() - t
            t = tick()
            old = legacy_reconstruct(loaded.model, full, context, prompt.repeat, 4, args.chunk)
            b = tick() - t
            for i in got:  # the same scores, up to float rounding
                torch.testing.assert_close(got[i], old[i], rtol=1e-4, atol=1e-6)
            now.append(a / p)
            before.append(b / p)
            name = f"{sample.id}"
            print(
                f"{name:>14} {context.shape[1]:>6} {p:>8.2f} {a:>9.2f} {a / p:>5.2f}x {b:>12.2f} {b / p:>5.2f}x",
                flush=True,
            )
    print(
        f"median pass / prefill: now {statistics.median(now):.2f}x (max {max(now):.2f}x), "
        f"before {statistics.median(before):.2f}x (max {max(before):.2f}x)"
    )


if __name__ == "__main__":
    main()
