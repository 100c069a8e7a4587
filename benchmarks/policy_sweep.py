"""Every policy at two budgets on four needle-style tasks, each task one sweep (one prefill per sample for all
variants), on SmolLM2; and one variant alone, to show what the sweep's shared prefill saves.

    python benchmarks/policy_sweep.py [--out DIR] [--budgets 0.5 0.25] [--samples 1] [--only needle]
        [--policies lagkv cur] [OVERRIDE...]

Runs (each `python -m evalkit ... 'variants=[...]'`, every policy in conf/policy but `none`; the wrappers over
snapkv, block and chunk over keydiff):
  needle            task=needle (query-agnostic: the question after compression)
  needle_aware      task=needle protocol=query_aware (the question inside the compressed prompt)
  middoc            task=middoc
  multikey          task=multikey
  single            task=needle variants=[snapkv@0.25] (one variant, for the time ratio)
Prints one markdown table: per variant and run, accuracy with the samples lost/gained against the baseline, the KV
ratio (deployed fp16 bytes vs the full cache), and the wall seconds of each sweep beside the single variant's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalkit.config.choices import options  # noqa: E402

# a wrapper -> the inner policy it runs over
WRAPPERS = {"chunkkv": "snapkv", "adakv": "snapkv", "criticalkv": "snapkv", "criticaladakv": "snapkv"}
WRAPPERS |= {"per_layer": "snapkv", "entropy_chunkkv": "snapkv", "key_rerotation": "snapkv", "merging": "snapkv"}
WRAPPERS |= {"think": "snapkv"}  # ThinK after SnapKV's tokens (alone, policy=think, it keeps every token)
WRAPPERS |= {"block": "keydiff", "chunk": "keydiff"}
RUNS = {
    "needle": ["task=needle"],
    "needle_aware": ["task=needle", "protocol=query_aware"],
    "middoc": ["task=middoc"],
    "multikey": ["task=multikey"],
}


def variants(budgets: list[str], policies: list[str] | None = None) -> list[str]:
    chosen = [n for n in options("policy") if n != "none" and (not policies or n in policies)]
    names = [f"{n}({WRAPPERS[n]})" if n in WRAPPERS else n for n in chosen]
    return [f"{n}@{b}" for b in budgets for n in names]


def evalkit(out: Path, *args: str) -> float:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "evalkit", *args, f"hydra.run.dir={out}"], cwd=ROOT, env=env, capture_output=True
    )
    if proc.returncode not in (0,):
        sys.exit(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    return time.perf_counter() - t


def per_sample_seconds(rows_path: Path) -> tuple[float, float]:
    """Mean seconds per sample (shared, separate) from the rows of one sweep: shared = one prefill (and one KVzip
    reconstruction) + the baseline's decode + every variant's compression and decode; separate = for every variant,
    its own prefill (and reconstruction), compression, decode and baseline decode, as one run per variant would do."""
    by_sample: dict[str, list[dict]] = {}
    for line in rows_path.read_text().splitlines():
        row = json.loads(line)
        by_sample.setdefault(row["sample_id"], []).append(row)
    shared = separate = 0.0
    for rows in by_sample.values():
        base = next(r["seconds"] for r in rows if r["variant"] == "baseline")
        variants = [r["seconds"] for r in rows if r["variant"] != "baseline"]
        rebuilt = max((v.get("reconstruct", 0.0) for v in variants), default=0.0)
        shared += base["prefill"] + rebuilt + base["decode"] + sum(v["compress"] + v["decode"] for v in variants)
        separate += sum(
            v["prefill"] + v.get("reconstruct", 0.0) + v["compress"] + v["decode"] + base["decode"] for v in variants
        )
    return shared / len(by_sample), separate / len(by_sample)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/evalkit-sweep")
    ap.add_argument("--budgets", nargs="+", default=["0.5", "0.25"])
    ap.add_argument("--samples", default="1", help="task.samples_per_cell")
    ap.add_argument("--only", nargs="*", default=list(RUNS) + ["single"])
    ap.add_argument("--policies", nargs="*", help="only these conf/policy names (default: every one)")
    ap.add_argument("overrides", nargs="*", help="more evalkit overrides for every run, e.g. model=tiny-random")
    args = ap.parse_args()
    out = Path(args.out)
    listed = variants(args.budgets, args.policies)
    quoted = ",".join(f'"{v}"' for v in listed)
    seconds, summaries = {}, {}
    for name in [r for r in [*RUNS, "single"] if r in args.only]:
        folder = out / name
        if (folder / "summary.json").exists():  # resumed: a run already done is read, not rerun
            seconds[name] = json.loads((folder / "seconds.json").read_text())["wall"]
        else:
            run = RUNS.get(name, ["task=needle"])
            chosen = "variants=[snapkv@0.25]" if name == "single" else f"variants=[{quoted}]"
            seconds[name] = evalkit(folder, *run, chosen, f"task.samples_per_cell={args.samples}", *args.overrides)
            (folder / "seconds.json").write_text(json.dumps({"wall": seconds[name]}))
        summaries[name] = json.loads((folder / "summary.json").read_text())
        print(f"{name}: {seconds[name]:.0f} s", file=sys.stderr)
    runs = [r for r in RUNS if r in summaries]
    print("| variant | " + " | ".join(f"{r}: acc (lost/gained)" for r in runs) + " | KV ratio |")
    print("|---|" + "---:|" * (len(runs) + 1))
    for v in ["baseline", *listed]:
        cells = []
        for r in runs:
            s = summaries[r].get(v)
            cells.append("-" if s is None else f"{s['accuracy']:.2f} ({s['lost']}/{s['gained']})")
        ratio = next((summaries[r][v]["kv_ratio"] for r in runs if v in summaries[r]), None)
        shown = "-" if ratio is None else f"{ratio:.3f}"
        print(f"| `{v}` | " + " | ".join(cells) + f" | {shown} |")
    n = {r: summaries[r]["baseline"]["n"] for r in summaries}
    print()
    print("| run | variants | samples | wall s | s per sample |")
    print("|---|---:|---:|---:|---:|")
    for r in summaries:
        k = 1 if r == "single" else len(listed)
        print(f"| {r} | {k} | {n[r]} | {seconds[r]:.0f} | {seconds[r] / n[r]:.1f} |")
    for r in runs:  # from one run's own rows: what the shared prefill saves against one run per variant
        shared, separate = per_sample_seconds(out / r / "samples.jsonl")
        print(
            f"\n{r}: per sample, the sweep's model time {shared:.1f} s against {separate:.1f} s for one run per "
            f"variant ({separate / shared:.1f}x), from the rows' own seconds"
        )
    if "single" in seconds and "needle" in seconds:
        print(
            f"\nneedle sweep / single variant: {seconds['needle'] / seconds['single']:.1f}x the time for "
            f"{len(listed)}x the variants"
        )


if __name__ == "__main__":
    main()
