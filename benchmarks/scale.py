"""How evalkit's cost grows with the context: seconds and memory per mode at each length, and a log-log slope per mode.

    python benchmarks/scale.py [--model smollm2-135m] [--lengths 1024 2048 4096] [--modes snapkv h2o ...]
        [--out /tmp/evalkit-scale]

For each length and mode, one `python -m evalkit task=needle` run of one sample (depth 0.5, 8 new tokens) in a process
of its own, and from it:
- `cpu s`: the process's CPU seconds (user + system, os.wait4), which includes loading the model;
- `mode s`: the variant's own seconds to its compressed cache, from its row (prefill, KVzip's reconstruction,
  compression), and `decode s` its decode of the answer;
- `floor s`: the plain prefill of the same context: the baseline mode's (policy=none) prefill at that length when
  it is among the modes (the baseline row of a policy's own run shares the policy's prefill, observations included,
  so it is no floor), else the run's baseline row's;
- `rss MiB`: the process's peak resident memory (ru_maxrss);
- `peak KV MiB`: evalkit's own peak of KV bytes for the variant (its row's `peak_kv_bytes`; while prefilling,
  `prefill_peak_kv_bytes`).
Then per mode the slope of log(mode s) and of log(peak KV) against log(length) (numpy's least squares). Modes:
baseline (policy=none), snapkv, h2o, streaming_llm, kvzip (all at a quarter), int4 (policy=none quant=int4) and
chunked (SnapKV at 256 tokens, chunks of 512). Seconds are this machine's; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "baseline": ["policy=none"],
    "snapkv": ["policy=snapkv", "policy.budget=0.25"],
    "h2o": ["policy=h2o", "policy.budget=0.25"],
    "streaming_llm": ["policy=streaming_llm", "policy.budget=0.25"],
    "kvzip": ["policy=kvzip", "policy.budget=0.25"],
    "int4": ["policy=none", "quant=int4"],
    "chunked": ["policy=snapkv", "policy.budget=256", "prefill=chunked", "prefill.chunk=512"],
}
MIB = 2**20


def run(model: str, length: int, mode: str, out: Path) -> dict:
    """One run into `out`: its process's CPU seconds and peak RSS, and the figures of its variant's row."""
    args = [sys.executable, "-m", "evalkit", f"model={model}", "task=needle", f"task.context_lengths=[{length}]"]
    args += ["task.depths=[0.5]", "task.samples_per_cell=1", "task.max_new_tokens=8", *MODES[mode]]
    args += ["prefill.compare_oneshot=false"] if mode == "chunked" else []
    args += [f"hydra.run.dir={out}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) not in (0, 1):  # 1: the gate's FAIL, still a measured run
        raise SystemExit(f"{mode} at {length}: exit {os.waitstatus_to_exitcode(status)}; see {out.with_suffix('.log')}")
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    base = next(r for r in rows if r["variant"] == "baseline")
    row = next((r for r in rows if r["variant"] != "baseline"), base)
    s = row["seconds"]
    return {
        "cpu": usage.ru_utime + usage.ru_stime,
        "mode": s["prefill"] + s.get("reconstruct", 0.0) + s["compress"],
        "decode": s["decode"],
        "floor": base["seconds"]["prefill"],
        "rss": usage.ru_maxrss * 1024 / MIB,
        "peak_kv": row["peak_kv_bytes"] / MIB,
        "prefill_peak_kv": row["prefill_peak_kv_bytes"] / MIB,
        "tokens": row["context_tokens"],
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """The log-log least-squares slope; nan for a mode measured at one length (its row then prints "nan")."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0]) if len(xs) > 1 else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--out", default="/tmp/evalkit-scale")
    ap.add_argument("--tables", action="store_true", help="only print the tables of OUT/scale.json, run nothing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, dict[int, dict]] = {}
    if args.tables:
        got = {m: {int(n): f for n, f in by.items()} for m, by in json.loads((out / "scale.json").read_text()).items()}
    for length in [] if args.tables else args.lengths:
        for mode in args.modes:
            got.setdefault(mode, {})[length] = figures = run(args.model, length, mode, out / f"{mode}-{length}")
            print(f"{mode} {length}: {json.dumps({k: round(v, 2) for k, v in figures.items()})}", file=sys.stderr)
            (out / "scale.json").write_text(json.dumps(got, indent=1))
    for by_length in got.values():  # the floor: the plain prefill's, from the baseline mode where it ran
        for length, f in by_length.items():
            plain = got.get("baseline", {}).get(length)
            f["floor"] = plain["mode"] if plain else f["floor"]
    columns = ["mode", "tokens", "cpu s", "mode s", "floor s", "mode / floor", "decode s", "rss MiB", "peak KV MiB"]
    print("| " + " | ".join([*columns, "prefill peak KV MiB"]) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, by_length in got.items():
        for f in by_length.values():
            print(
                f"| {mode} | {f['tokens']} | {f['cpu']:.1f} | {f['mode']:.2f} | {f['floor']:.2f} | "
                f"{f['mode'] / f['floor']:.2f}x | {f['decode']:.2f} | {f['rss']:.0f} | {f['peak_kv']:.1f} | "
                f"{f['prefill_peak_kv']:.1f} |"
            )
    if max(len(by_length) for by_length in got.values()) < 2:
        return  # one length: no slope to fit
    print()
    print("| mode | slope of mode s | slope of the floor | slope of peak KV |")
    print("|---|---:|---:|---:|")
    for mode, by_length in got.items():
        xs = [f["tokens"] for f in by_length.values()]
        col = {k: [f[k] for f in by_length.values()] for k in ("mode", "floor", "peak_kv")}
        fitted = [slope(xs, col[k]) for k in ("mode", "floor", "peak_kv")]
        print(f"| {mode} | " + " | ".join(f"{x:.2f}".replace("-0.00", "0.00") for x in fitted) + " |")


if __name__ == "__main__":
    main()
