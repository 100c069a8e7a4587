"""Seconds per sample against NVIDIA kvpress: evalkit's baseline plus one policy (one run) against kvpress's two
pipeline passes (the full cache, then the press), on the same needle samples and the same model (SmolLM2, or
Gemma-3-270M with --model gemma3-270m).

    .venv/bin/python benchmarks/kvpress_time.py --kvpress-python /tmp/kvpress-venv/bin/python \
        [--model smollm2-135m] [--policy snapkv|h2o|kvzip] [--lengths 2048] [--samples 3] [--threads 1] [--clock cpu]
        [--warmup-length N]

kvpress (0.5.5, its own venv, see benchmarks/peer_kvpress.py) runs through benchmarks/_kvpress_time_side.py on the
samples' context, question and answer prefix: its pipeline applies the chat template and decodes greedily, as
evalkit does (its question ids lack the two newlines evalkit's prompt puts between context and question).
Pairs (kvpress press at compression ratio 0.75 <-> evalkit policy keeping kvpress's count, int(T x 0.25)):
SnapKVPress (window 64, kernel 5) <-> snapkv (window 64); ObservedAttentionPress (eager attention, as kvpress needs;
its baseline pass keeps SDPA) <-> h2o (normalize, no recent window, compress once); KVzipPress <-> kvzip. evalkit's
side: `run_sample` with the baseline and the one variant (one prefill, one batched decode), the call a
single-policy run makes per sample; and, as the floor of any run that prefills each context once with this forward,
a plain prefill of the context alone (no policy, no decode). Both sides use the same torch threads and clock (CPU
seconds by default: other jobs on a shared machine barely move them); printed per sample and in total, with the
answers' agreement, and each side's peak resident memory (one length per invocation: that length's peak).
Each side's untimed warm-up call runs on the first sample, or with --warmup-length N on a needle sample of N tokens
(at 32k a full-length warm-up is a third prefill per side, half an hour at one thread, where 1k tokens warm the
same code paths).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from evalkit.cli.spec import model_spec
from evalkit.embedded import cache_root
from evalkit.engine import models
from evalkit.engine.engine import Variant, prefill, run_sample
from evalkit.policies.h2o import H2O
from evalkit.policies.kvzip import KVzip
from evalkit.policies.snapkv import SnapKV
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt

ROOT = Path(__file__).resolve().parent.parent
SIDE = Path(__file__).resolve().parent / "_kvpress_time_side.py"
RATIO = 0.75  # kvpress's compression ratio: the fraction removed
PRESS = {"snapkv": "snapkv", "h2o": "observed_attention", "kvzip": "kvzip"}


def policy(name: str, k: int):
    if name == "snapkv":
        return SnapKV(budget=k, window=64, kernel=5, pooling="avg")
    if name == "h2o":
        return H2O(budget=k, recent=0.0, normalize=True, decode=False)
    return KVzip(budget=k)


def run_kvpress(args, model_dir: Path, samples, warmup) -> dict:
    def fields(s):
        return {"id": s.id, "context": s.context, "question": s.question, "answer_prefix": s.answer_prefix}

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps({"samples": [fields(s) for s in samples], "warmup": fields(warmup)}))
        cmd = [args.kvpress_python, str(SIDE), "--model", str(model_dir), "--input", str(src), "--output", str(dst)]
        cmd += ["--press", PRESS[args.policy], "--ratio", str(RATIO), "--max-new-tokens", str(args.max_new_tokens)]
        cmd += ["--threads", str(args.threads), "--clock", args.clock]
        subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""})
        return json.loads(dst.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvpress-python", default=os.environ.get("KVPRESS_PYTHON", "/tmp/kvpress-venv/bin/python"))
    ap.add_argument("--model", choices=["smollm2-135m", "gemma3-270m"], default="smollm2-135m")
    ap.add_argument("--policy", choices=list(PRESS), default="snapkv")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--samples", type=int, default=3, help="needle samples per length (depths spread over 0..1)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--warmup-length", type=int, help="the warm-up sample's tokens (default: the first sample)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tick = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg = model_spec(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml"))
    loaded = models.load(cfg, "cpu")
    depths = [i / max(1, args.samples - 1) for i in range(args.samples)]
    samples = [
        s for n in args.lengths for s in NeedleTask(context_lengths=[n], depths=depths).samples(loaded.tokenizer)
    ]
    warmup = samples[0]
    if args.warmup_length:
        (warmup,) = NeedleTask(context_lengths=[args.warmup_length], depths=[0.0]).samples(loaded.tokenizer)
    peer = run_kvpress(args, cache_root() / f"{cfg.name}-{cfg.package_version}", samples, warmup)
    print(f"{args.threads} thread(s), {args.clock} seconds; kvpress {peer['meta']}", flush=True)
    stop = {loaded.tokenizer.eos_token_id}
    prompts = [build_prompt(loaded.tokenizer, s) for s in samples]
    first = build_prompt(loaded.tokenizer, warmup)
    run_sample(loaded.model, first, [Variant(policy(args.policy, 16))], args.max_new_tokens, stop)  # warm-up
    print(
        f"{'sample':>14} {'tokens':>6} {'evalkit s':>9} {'kvpress s':>9} {'ratio':>6} {'prefill s':>9} {'floor':>6}  "
        "answers (evalkit | kvpress)"
    )
    ours_total = theirs_total = prefill_total = agree = 0.0
    for sample, prompt, row in zip(samples, prompts, peer["rows"], strict=True):
        k = int(prompt.n_context * (1 - RATIO))
        t = tick()
        base, (out,) = run_sample(loaded.model, prompt, [Variant(policy(args.policy, k))], args.max_new_tokens, stop)
        ours = tick() - t
        t = tick()
        prefill(loaded.model, prompt.ids[:, : prompt.n_context])  # the context alone, no policy: the floor
        alone = tick() - t
        theirs = row["baseline_s"] + row["press_s"]
        ours_total, theirs_total, prefill_total = ours_total + ours, theirs_total + theirs, prefill_total + alone
        texts = [loaded.tokenizer.decode(o.tokens, skip_special_tokens=True).strip() for o in (base, out)]
        agree += texts == [row["baseline"].strip(), row["press"].strip()]
        print(
            f"{sample.id:>14} {prompt.n_context:>6} {ours:>9.2f} {theirs:>9.2f} {ours / theirs:>5.2f}x "
            f"{alone:>9.2f} {alone / theirs:>5.2f}x  "
            f"{texts} | {[row['baseline'].strip(), row['press'].strip()]}",
            flush=True,
        )
    print(
        f"total: evalkit {ours_total:.1f} s, kvpress {theirs_total:.1f} s, ratio {ours_total / theirs_total:.2f}x; "
        f"answers identical on {agree:.0f}/{len(samples)} samples"
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: evalkit's process {rss:.0f} MiB, kvpress's {peer['meta'].get('peak_rss_mib', '?')} MiB")
    print(
        f"floor: evalkit's plain prefill of the contexts alone {prefill_total:.1f} s, "
        f"{prefill_total / theirs_total:.2f}x kvpress's two passes "
        "(what any run that prefills each context once, at this forward's speed, spends at least)"
    )


if __name__ == "__main__":
    sys.exit(main())
