"""The kvpress half of benchmarks/kvpress_time.py: run in kvpress's own venv, never in evalkit's.

    /tmp/kvpress-venv/bin/python benchmarks/_kvpress_time_side.py --model DIR --input in.json --output out.json \
        --press snapkv --ratio 0.75 --max-new-tokens 16 --threads 1 --clock cpu

Imports only kvpress, transformers and torch. For every sample of `in.json` ({"samples": [{"id", "context",
"question", "answer_prefix"}]}) it runs kvpress's own pipeline twice, as a kvpress user compares a press with the
full cache: once without a press (the baseline, SDPA) and once with it (SDPA, or eager attention where the press
needs the attention matrices), and times each call (CPU seconds of this process by default). A warm-up call on the
first sample (or on `in.json`'s "warmup" sample where it has one) is not timed. Its peak resident memory (ru_maxrss)
goes into the output's `meta`.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import kvpress
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline


def make_press(name: str, ratio: float):
    """name -> (press, the attention implementation it needs)."""
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio), "sdpa"  # window 64, kernel 5 (kvpress's defaults)
    if name == "observed_attention":
        return kvpress.ObservedAttentionPress(compression_ratio=ratio), "eager"
    if name == "kvzip":
        return kvpress.KVzipPress(compression_ratio=ratio), "sdpa"
    raise ValueError(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--input", "--output", "--press"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--ratio", type=float, default=0.75)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    tick = time.process_time if args.clock == "cpu" else time.perf_counter
    given = json.load(open(args.input))
    samples = given["samples"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    press, impl = make_press(args.press, args.ratio)

    def call(sample, with_press: bool):
        model.set_attn_implementation(impl if with_press else "sdpa")
        t = tick()
        out = pipe(
            sample["context"],
            question=sample["question"],
            answer_prefix=sample["answer_prefix"],
            press=press if with_press else None,
            max_new_tokens=args.max_new_tokens,
        )
        return out["answer"], tick() - t

    warmup = given.get("warmup", samples[0])
    call(warmup, False)  # warm-up: the first forward is slower
    call(warmup, True)
    rows = []
    for sample in samples:
        base, base_s = call(sample, False)
        ans, press_s = call(sample, True)
        rows.append({"baseline": base, "baseline_s": base_s, "press": ans, "press_s": press_s})
        print(f"kvpress {sample['id']}: baseline {base_s:.2f} s, {args.press} {press_s:.2f} s", flush=True)
    meta = {
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "?",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        # this process's peak resident memory over every call (one length per invocation: that length's peak)
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    json.dump({"meta": meta, "rows": rows}, open(args.output, "w"))


if __name__ == "__main__":
    main()
