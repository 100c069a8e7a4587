"""What score-based eviction costs on SmolLM2: time, peak memory, and the sweep's saving.

    python benchmarks/eviction_cost.py time     [--lengths 2048 8192] [--reps 2] [--policies h2o] [--clock cpu]
    python benchmarks/eviction_cost.py memory   [--length 8192] [--reps 3] [--no-eager]
    python benchmarks/eviction_cost.py sweep    [--length 2048] [--samples 8]
    python benchmarks/eviction_cost.py variants [--length 2048] [--samples 5] [--threads 1 --clock cpu]

time:   prefill + scoring + compression vs a plain SDPA prefill, per policy (interleaved, median of reps).
memory: peak process memory (VmHWM, reset after the model loads and a short forward pages its weights in) of a
        prefill that scores for H2O or SnapKV vs a plain SDPA prefill, and a plain eager-attention prefill for
        contrast; each mode in its own fresh process, --reps times, under glibc's default malloc and under a fixed
        64 KiB mmap threshold (resident memory then follows what the prefill holds, not the heap's holes).
sweep:  4 policies x 3 budgets on the same needle samples in one sweep (one prefill per sample) vs the same
        12 variants run one by one (each run: prefill, baseline and its variant, as a single-policy run does).
variants: the same 12 variants against one (snapkv@0.25), per sample, interleaved: run_sample with the baseline and
        12 variants vs run_sample with the baseline and one, on the same samples in one run.
--clock cpu times the process's CPU seconds (with --threads 1, other jobs on a shared machine barely move them);
--clock wall (the default) wall seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from omegaconf import OmegaConf

from evalkit.cli.config import variants as configured_variants
from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.engine.engine import prefill, run_sample
from evalkit.kv.cache import compress
from evalkit.kv.variant import Variant
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt

CONF = os.path.join(os.path.dirname(__file__), "..", "conf", "model", "smollm2-135m.yaml")
POLICIES = ["h2o", "snapkv", "pyramidkv", "knorm", "random", "streaming_llm"]


def policies(specs: list[str]):
    return [v.policy for v in configured_variants(OmegaConf.create({"seed": 0, "variants": specs}))]


def load(attn: str = "sdpa"):
    """SmolLM2 under evalkit's SDPA, or under transformers' eager attention (for contrast: evalkit itself does not
    run eager attention, so the weights load as usual and the model is switched after)."""
    loaded = models.load(model_spec(OmegaConf.load(CONF)), "cpu")
    if attn == "eager":
        loaded.model.set_attn_implementation("eager")
    return loaded


def context_ids(loaded, length: int) -> torch.Tensor:
    (sample,) = NeedleTask(context_lengths=[length], depths=[0.5]).samples(loaded.tokenizer)
    p = build_prompt(loaded.tokenizer, sample)
    return p.ids[:, : p.n_context]


def clock(args):
    """The timer the run asked for: CPU seconds of this process, or wall seconds."""
    return time.process_time if args.clock == "cpu" else time.perf_counter


def bench_time(args) -> None:
    loaded = load()
    tick = clock(args)
    print(f"{'context':>8} {'policy':<16} {'plain prefill s':>16} {'prefill+score+compress s':>25} {'ratio':>7}")
    for length in args.lengths:
        ids = context_ids(loaded, length)
        prefill(loaded.model, ids)  # warm-up: the first forward at a new length is slower
        plain, scored = [], {p: [] for p in args.policies}
        for _ in range(args.reps):
            t = tick()
            prefill(loaded.model, ids)
            plain.append(tick() - t)
            for pol in policies([f"{p}@0.25" for p in args.policies]):
                t = tick()
                full, obs = prefill(loaded.model, ids, [pol])
                compress(full, pol, obs)
                scored[pol.name].append(tick() - t)
        base = statistics.median(plain)
        for name, times in scored.items():
            s = statistics.median(times)
            print(f"{ids.shape[1]:>8} {name:<16} {base:>16.2f} {s:>25.2f} {s / base:>6.2f}x")


def rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def memory_child(mode: str, length: int) -> None:
    loaded = load("eager" if mode == "eager" else "sdpa")
    ids = context_ids(loaded, length)
    pols = [] if mode in ("plain", "eager") else policies([f"{mode}@0.25"])
    prefill(loaded.model, ids[:, :32])  # every weight paged in: the peak is the prefill's, not the weights' first touch
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM): loading the model is not measured
        f.write("5")
    before = rss_mb("VmRSS")
    full, obs = prefill(loaded.model, ids, pols)
    if pols:
        compress(full, pols[0], obs)
    peak = rss_mb("VmHWM")
    print(json.dumps({"mode": mode, "tokens": int(ids.shape[1]), "rss_before_mb": before, "peak_mb": peak}))


# glibc's malloc serves blocks under its mmap threshold from its heap, and raises that threshold (up to 32 MiB) as
# large blocks are freed; the KV cache's tensors, kept, then sit between freed temporaries, whose holes stay resident.
# With a fixed threshold of 64 KiB every larger block is a mapping of its own, returned when freed: the peak resident
# memory then follows the memory the prefill holds, whatever order it allocated in.
ALLOCATORS = {"glibc default": {}, "64 KiB mmap threshold": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def bench_memory(args) -> None:
    modes = ["plain", "h2o", "snapkv"] + ([] if args.no_eager else ["eager"])
    print(f"{args.length} tokens; medians of {args.reps} fresh processes per mode (eager: one, glibc default)")
    print(
        f"{'allocator':<22} {'mode':<8} {'peak RSS MiB':>12} {'prefill MiB':>11} {'min-max':>11} {'peak vs plain':>13} "
        f"{'prefill vs plain':>16}"
    )
    for allocator, env in ALLOCATORS.items():
        results = {}
        for mode in modes:
            if mode == "eager" and env:
                continue
            runs = []
            for _ in range(1 if mode == "eager" else args.reps):
                out = subprocess.run(
                    [sys.executable, __file__, "memory-child", mode, str(args.length)],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, **env},
                )
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            above = [r["peak_mb"] - r["rss_before_mb"] for r in runs]
            results[mode] = (statistics.median(r["peak_mb"] for r in runs), statistics.median(above), above)
        plain_peak, plain_above, _ = results["plain"]
        for mode, (peak, above, each) in results.items():
            print(
                f"{allocator:<22} {mode:<8} {peak:>12.0f} {above:>11.0f} {min(each):>5.0f}-{max(each):<5.0f} "
                f"{peak / plain_peak:>12.2f}x {above / plain_above:>15.2f}x",
                flush=True,
            )


def bench_sweep(args) -> None:
    loaded = load()
    specs = [f"{p}@{b}" for p in ("snapkv", "h2o", "pyramidkv", "streaming_llm") for b in (0.1, 0.25, 0.5)]
    variants = [Variant(p) for p in policies(specs)]
    task = NeedleTask(context_lengths=[args.length], depths=[0.0, 0.25, 0.5, 0.75, 1.0], samples_per_cell=2)
    samples = task.samples(loaded.tokenizer)[: args.samples]
    prompts = [build_prompt(loaded.tokenizer, s, args.protocol) for s in samples]
    stop = {loaded.tokenizer.eos_token_id}
    correct = {v.name: 0 for v in variants} | {"baseline": 0}
    t = time.perf_counter()
    for s, p in zip(samples, prompts, strict=True):
        base, outs = run_sample(loaded.model, p, variants, task.max_new_tokens, stop)
        for out in [base, *outs]:
            correct[out.variant] += task.score(loaded.tokenizer.decode(out.tokens, skip_special_tokens=True), s)
    sweep = time.perf_counter() - t
    t = time.perf_counter()
    for v in variants:
        for p in prompts:
            run_sample(loaded.model, p, [v], task.max_new_tokens, stop)
    one_by_one = time.perf_counter() - t
    print(f"{len(variants)} variants x {len(prompts)} samples at {args.length} tokens, protocol {args.protocol}")
    print(f"sweep (one prefill per sample): {sweep:.1f} s")
    print(f"one by one (12 runs):           {one_by_one:.1f} s")
    print(f"speed-up: {one_by_one / sweep:.2f}x")
    print("needle accuracy in the sweep: " + ", ".join(f"{k} {v:g}/{len(prompts)}" for k, v in correct.items()))


def bench_variants(args) -> None:
    loaded = load()
    tick = clock(args)
    specs = [f"{p}@{b}" for p in ("snapkv", "h2o", "pyramidkv", "streaming_llm") for b in (0.1, 0.25, 0.5)]
    twelve = [Variant(p) for p in policies(specs)]
    one = [Variant(p) for p in policies(["snapkv@0.25"])]
    depths = [i / max(1, args.samples - 1) for i in range(args.samples)]
    task = NeedleTask(context_lengths=[args.length], depths=depths)
    stop = {loaded.tokenizer.eos_token_id}
    prompts = [build_prompt(loaded.tokenizer, s, args.protocol) for s in task.samples(loaded.tokenizer)]
    run_sample(loaded.model, prompts[0], one, task.max_new_tokens, stop)  # warm-up: a first forward is slower
    print(f"12 variants ({', '.join(specs)}) vs 1 ({one[0].name}); protocol {args.protocol}; {args.clock} seconds")
    print(f"{'sample':>14} {'tokens':>6} {'1 variant s':>11} {'12 variants s':>13} {'ratio':>6} {'shared':>6}")
    totals = [0.0, 0.0]
    for prompt, sample in zip(prompts, task.samples(loaded.tokenizer), strict=True):
        t = tick()
        run_sample(loaded.model, prompt, one, task.max_new_tokens, stop)
        a = tick() - t
        t = tick()
        _, outs = run_sample(loaded.model, prompt, twelve, task.max_new_tokens, stop)
        b = tick() - t
        totals = [totals[0] + a, totals[1] + b]
        shared = sum(o.decoded_like is not None for o in outs)  # variants whose decode was another's
        print(f"{sample.id:>14} {prompt.n_context:>6} {a:>11.2f} {b:>13.2f} {b / a:>5.2f}x {shared:>6}", flush=True)
    print(f"total: 1 variant {totals[0]:.1f} s, 12 variants {totals[1]:.1f} s, ratio {totals[1] / totals[0]:.2f}x")


def main() -> None:
    if sys.argv[1:2] == ["memory-child"]:
        memory_child(sys.argv[2], int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["time", "memory", "sweep", "variants"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--length", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--protocol", default="query_aware", choices=["query_agnostic", "query_aware"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--policies", nargs="+", default=POLICIES, help="time: the scorers to time (default: all)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--no-eager", action="store_true", help="memory: skip the eager-attention contrast")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "time":
        bench_time(args)
    elif args.what == "memory":
        args.length = args.length or 8192
        bench_memory(args)
    elif args.what == "sweep":
        args.length = args.length or 2048
        bench_sweep(args)
    else:
        args.length = args.length or 2048
        bench_variants(args)


if __name__ == "__main__":
    main()
