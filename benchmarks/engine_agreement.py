"""Does evalkit's simulation predict the engine? The same samples through evalkit's own int8/int4 KV storage
(backend=hf) and llama.cpp's q8_0/q4_0 caches (backend=llamacpp, and with --openai its server too, backend=openai).

    python benchmarks/engine_agreement.py [--out results/engine_agreement] [--openai] [TASK OVERRIDES ...]
    e.g. python benchmarks/engine_agreement.py --openai task=needle 'task.context_lengths=[2048]' \
        task.samples_per_cell=4

Prints numbers only (BENCHMARKS.md records them): per pair of variants (int8 ~ q8_0, int4 ~ q4_0) the 2x2 table of
samples that flipped against their own engine's full-cache baseline (yes/no on each side), the share that agree,
Cohen's kappa, and each variant's accuracy beside its baseline's; then what a sample costs on each backend. Each
backend is one `python -m evalkit` run in a fresh folder (rerunning resumes it; delete --out to measure afresh).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from statsmodels.stats.inter_rater import cohens_kappa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.llama_servers: the same server the tests start

PAIRS = [("none@1.0+int8", "llamacpp:q8_0", "q8_0"), ("none@1.0+int4", "llamacpp:q4_0", "q4_0")]
GGML = {"f16": 1, "q4_0": 2, "q8_0": 8}


def children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes so far: less sensitive to a loaded machine than
    wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# OpenMP threads that spin while they wait (torch's and llama.cpp's) slow each other down many times over on a shared
# CPU: every engine here waits passively, so that they compare under the same rule
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def evalkit(folder: Path, *args: str) -> tuple[float, float]:
    """Run `python -m evalkit ARGS` into `folder`; its wall and CPU seconds."""
    start, cpu = time.perf_counter(), children_cpu()
    argv = [sys.executable, "-m", "evalkit", *args, f"hydra.run.dir={folder}"]
    done = subprocess.run(argv, cwd=ROOT, env=ENV, text=True)
    if done.returncode not in (0, 1, 2):
        raise SystemExit(f"python -m evalkit {' '.join(args)} exited {done.returncode}")
    return time.perf_counter() - start, children_cpu() - cpu


def rows(folder: Path) -> dict[tuple[str, str], dict]:
    lines = (folder / "samples.jsonl").read_text().splitlines()
    return {(r["sample_id"], r["variant"]): r for r in map(json.loads, lines)}


def flipped(r: dict) -> bool:
    return r["flip"] is not None


def agreement(hf: dict, llama: dict, a: str, b: str) -> dict:
    """The 2x2 table of flips of variant `a` (hf rows) and `b` (llama.cpp rows) on the samples both ran."""
    ids = sorted({s for s, v in hf if v == a} & {s for s, v in llama if v == b})
    table = [[0, 0], [0, 0]]  # [hf flipped][llama.cpp flipped]
    for s in ids:
        table[int(flipped(hf[(s, a)]))][int(flipped(llama[(s, b)]))] += 1
    n = len(ids)
    kappa = float("nan")
    if table[0][1] + table[1][0] + table[1][1] and table[0][0] + table[0][1] + table[1][0]:
        kappa = float(cohens_kappa(table, return_results=False))
    return {"n": n, "table": table, "agree": (table[0][0] + table[1][1]) / n if n else math.nan, "kappa": kappa}


def accuracy(table: dict, variant: str) -> tuple[float, float, int, int]:
    """(baseline accuracy, variant accuracy, lost, gained) of a variant on its engine."""
    rs = [r for (_, v), r in table.items() if v == variant]
    lost = sum(r["flip"] == "lost" for r in rs)
    gained = sum(r["flip"] == "gained" for r in rs)
    return sum(r["baseline_score"] for r in rs) / len(rs), sum(r["score"] for r in rs) / len(rs), lost, gained


def engine_seconds(table: dict) -> float:
    """Seconds the engine spent per sample on the baseline and every variant (the rows' `seconds`). evalkit's own
    engine prefills a sample once for all (each of its rows repeats that prefill's seconds): counted once."""
    per: dict[str, float] = {}
    prefill: dict[str, float] = {}
    for (s, _), r in table.items():
        seconds = dict(r["seconds"])
        if r.get("backend", "hf") == "hf":
            prefill[s] = seconds.pop("prefill", 0.0)
        per[s] = per.get(s, 0.0) + sum(seconds.values())
    return sum(per[s] + prefill.get(s, 0.0) for s in per) / len(per)


def serve_and_run(folder: Path, overrides: list[str], n_ctx: int) -> tuple[float, float]:
    """llama.cpp's server with f16, q8_0 and q4_0 caches, and the same task through backend=openai: wall and CPU
    seconds, the servers' CPU included (they are this process's children, counted once stopped)."""
    from tests.llama_servers import LlamaServer

    cpu = children_cpu()
    servers = {name: LlamaServer(GGML[name], GGML[name], n_ctx=n_ctx) for name in ("f16", "q8_0", "q4_0")}
    try:
        urls = {"baseline": servers["f16"].url, "q8_0": servers["q8_0"].url, "q4_0": servers["q4_0"].url}
        endpoints = "backend.endpoints={" + ",".join(f'{k}:"{v}"' for k, v in urls.items()) + "}"
        args = ["backend=openai", endpoints, "backend.kv_dtypes={baseline:f16}", "backend.extra={repeat_penalty:1.0}"]
        wall, _ = evalkit(folder, *args, *overrides)
    finally:
        for s in servers.values():
            s.stop()
    return wall, children_cpu() - cpu


def print_agreement(hf: dict, llama: dict) -> None:
    print("| pair | n | both flipped | hf only | llama.cpp only | neither | agree | Cohen's kappa |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for a, b, _ in PAIRS:
        g = agreement(hf, llama, a, b)
        (nn, ny), (yn, yy) = g["table"]
        kappa = "undefined (no flip)" if math.isnan(g["kappa"]) else f"{g['kappa']:.3f}"
        print(f"| {a} ~ {b} | {g['n']} | {yy} | {yn} | {ny} | {nn} | {g['agree']:.3f} | {kappa} |")


def fidelity(table: dict, variant: str) -> str:
    """Mean top-1 agreement and KL (nats) of a variant's answer positions against the baseline's, where its rows
    have them (backends; evalkit's own engine records fidelity for teacher-forced tasks only)."""
    found = [r["fidelity"] for (_, v), r in table.items() if v == variant and r.get("fidelity")]
    found = [f for f in found if f["kl_mean"] is not None]
    if not found:
        return "-"
    top1 = sum(f["top1_agreement"] for f in found) / len(found)
    return f"{top1:.3f} / {sum(f['kl_mean'] for f in found) / len(found):.4f}"


def print_accuracy(hf: dict, llama: dict) -> None:
    print("| engine | variant | baseline acc. | variant acc. | lost | gained | KV ratio | top-1 / KL at the answer |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for engine, table, names in (("hf", hf, [a for a, _, _ in PAIRS]), ("llama.cpp", llama, [b for _, b, _ in PAIRS])):
        for v in names:
            base, acc, lost, gained = accuracy(table, v)
            ratios = [r["kv_bytes_deployed"] / r["kv_bytes_baseline_deployed"] for (_, x), r in table.items() if x == v]
            ratio = sum(ratios) / len(ratios)
            print(
                f"| {engine} | {v} | {base:.3f} | {acc:.3f} | {lost} | {gained} | {ratio:.3f}x | {fidelity(table, v)} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "engine_agreement")
    ap.add_argument("--openai", action="store_true", help="also run the task through llama.cpp's server")
    ap.add_argument("--fresh", action="store_true", help="delete --out first")
    ap.add_argument("--n-ctx", type=int, default=2048, help="the servers' context (prompt + answer), tokens")
    ap.add_argument("overrides", nargs="*", default=["task=needle", "task.context_lengths=[2048]"])
    args = ap.parse_args()
    if args.fresh:
        shutil.rmtree(args.out, ignore_errors=True)
    hf_time = evalkit(args.out / "hf", "variants=[none@1.0+int8,none@1.0+int4]", *args.overrides)
    llama_variants = "variants=[llamacpp:q8_0,llamacpp:q4_0]"
    llama_time = evalkit(args.out / "llamacpp", "backend=llamacpp", llama_variants, *args.overrides)
    hf, llama = rows(args.out / "hf"), rows(args.out / "llamacpp")
    base = sorted(s for s, v in hf if v == "baseline")
    same = sum(hf[(s, "baseline")]["prediction"] == llama[(s, "baseline")]["prediction"] for s in base)
    print(f"{len(base)} samples ({' '.join(args.overrides)})")
    hf_base, llama_base = accuracy(hf, PAIRS[0][0])[0], accuracy(llama, PAIRS[0][1])[0]
    print(f"full-cache baselines: hf {hf_base:.3f}, llama.cpp f16 {llama_base:.3f}; the same answer on {same} of")
    print(f"{len(base)} samples\n")
    print_agreement(hf, llama)
    print()
    print_accuracy(hf, llama)
    costs = [("hf", *hf_time, engine_seconds(hf)), ("llamacpp", *llama_time, engine_seconds(llama))]
    if args.openai:
        wall, cpu = serve_and_run(args.out / "openai", args.overrides, args.n_ctx)
        if not (args.out / "openai" / "samples.jsonl").is_file():
            raise SystemExit("the openai route was refused (its reason is printed above)")
        served = rows(args.out / "openai")
        costs.append(("openai (3 llama_cpp.server)", wall, cpu, engine_seconds(served)))
        agree = sum(served[(s, "baseline")]["prediction"] == llama[(s, "baseline")]["prediction"] for s in base)
        print(f"\nopenai route: the in-process baseline's answer on {agree} of {len(base)} samples")
    n = len(base)
    print("\n| backend | wall s | CPU s | CPU s per sample | vs hf | engine wall s per sample | vs hf |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, wall, cpu, engine in costs:
        print(
            f"| {name} | {wall:.0f} | {cpu:.0f} | {cpu / n:.2f} | {cpu / costs[0][2]:.2f}x | {engine:.2f} | "
            f"{engine / costs[0][3]:.2f}x |"
        )


if __name__ == "__main__":
    main()
