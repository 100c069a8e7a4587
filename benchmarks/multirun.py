"""Two evalkit jobs in parallel (Hydra's joblib launcher) vs the same two one after the other, on SmolLM2.

    python benchmarks/multirun.py [--reps 3] [--length 1024]

The jobs: needle at `length` tokens, depths 0, 0.5 and 1, with h2o and with streaming_llm at a quarter of the cache.
Three ways, interleaved in every repetition, each from a fresh results folder:
  joblib:     python -m evalkit -m policy=h2o,streaming_llm ... hydra/launcher=joblib hydra.launcher.n_jobs=2
  basic -m:   python -m evalkit -m policy=h2o,streaming_llm ...          (Hydra's basic launcher: one process)
  two runs:   python -m evalkit policy=h2o ... ; python -m evalkit policy=streaming_llm ...
Wall seconds of the whole commands, median over repetitions, and each way's ratio to `two runs` within a repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def evalkit(*args: str) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "evalkit", *args], cwd=ROOT, env=env, check=True, capture_output=True)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def threads(folder: Path) -> list[int]:
    return sorted(json.loads(p.read_text()).get("torch_threads", 0) for p in folder.rglob("run.json"))


def ways(task: list[str], out: Path) -> dict:
    """The three ways to run the two jobs, each writing under `out`."""
    two = ("h2o", "streaming_llm")
    return {
        "joblib": lambda: evalkit(
            "-m",
            *task,
            "policy=h2o,streaming_llm",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            f"hydra.sweep.dir={out / 'joblib'}",
        ),
        "basic -m": lambda: evalkit("-m", *task, "policy=h2o,streaming_llm", f"hydra.sweep.dir={out / 'basic'}"),
        "two runs": lambda: [evalkit(*task, f"policy={p}", f"hydra.run.dir={out / 'two' / p}") for p in two],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--length", type=int, default=1024)
    args = ap.parse_args()
    task = ["task=needle", f"task.context_lengths=[{args.length}]", "task.depths=[0.0,0.5,1.0]", "policy.budget=0.25"]
    times: dict[str, list[float]] = {"joblib": [], "basic -m": [], "two runs": []}
    ratios: dict[str, list[float]] = {"joblib": [], "basic -m": []}
    seen_threads = {}
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            run = ways(task, out)
            order = list(run) if rep % 2 == 0 else list(reversed(run))
            this = {name: timed(run[name]) for name in order}
            for name, t in this.items():
                times[name].append(t)
            for name in ratios:
                ratios[name].append(this[name] / this["two runs"])
            folders = {"joblib": "joblib", "basic -m": "basic", "two runs": "two"}
            seen_threads = {name: threads(out / folder) for name, folder in folders.items()}
    print(f"machine: {os.cpu_count()} CPUs; {args.reps} repetitions; each job: 3 needles at {args.length} tokens")
    head = f"{'way':<10} {'median s':>9} {'min s':>7} {'max s':>7} {'ratio to two runs (median)':>27}"
    print(head + f" {'torch threads per job':>22}")
    for name, ts in times.items():
        r = f"{statistics.median(ratios[name]):.2f}x" if name in ratios else "1.00x"
        print(
            f"{name:<10} {statistics.median(ts):>9.1f} {min(ts):>7.1f} {max(ts):>7.1f} {r:>27} "
            f"{str(seen_threads.get(name)):>22}"
        )


if __name__ == "__main__":
    main()
