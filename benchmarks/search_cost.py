"""What a budget search costs against one variant, on the same samples, measured in one run of this script.

    python benchmarks/search_cost.py [--samples 2] [--model smollm2-135m] [--out /tmp/search_cost]

Runs `python -m evalkit` three times on needle at 1024 tokens (5 depths x `--samples`): one variant (snapkv@0.5),
a search of 2 policies x 4 budgets (8 variants, one prefill per sample for all), and a search of 4 policies x 4
budgets (16 variants). Prints each run's wall time, its seconds per sample, and the ratio to the one-variant run;
"separate runs" is the one-variant run's time times the variants (one run per budget, each with its own prefill
and baseline), for comparison. Run it on an idle machine: the ratios are what to read.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

BASE = ["task=needle", "task.context_lengths=[1024]", "protocol=query_aware", "gate=none"]
RUNS = {
    "one variant (snapkv@0.5)": (["variants=[snapkv@0.5]"], 1),
    "search 2 policies x 4 budgets": (
        ["search.policies=[snapkv,streaming_llm]", "search.budgets=[0.75,0.5,0.35,0.25]"],
        8,
    ),
    "search 4 policies x 4 budgets": (
        ["search.policies=[snapkv,streaming_llm,pyramidkv,tova]", "search.budgets=[0.75,0.5,0.35,0.25]"],
        16,
    ),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2, help="samples per depth (5 depths)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("/tmp/search_cost"))
    a = ap.parse_args(argv)
    shutil.rmtree(a.out, ignore_errors=True)
    n = 5 * a.samples
    print(f"needle, 1024 tokens, {n} samples, model {a.model}, one process after the other")
    print("| run | variants | wall s | s per sample | x one variant | separate runs (x one variant) |")
    print("|---|---:|---:|---:|---:|---:|")
    first = None
    for i, (name, (overrides, variants)) in enumerate(RUNS.items()):
        cmd = [sys.executable, "-m", "evalkit", f"model={a.model}", *BASE, *overrides,
               f"task.samples_per_cell={a.samples}", f"hydra.run.dir={a.out / str(i)}"]  # fmt: skip
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        first = first or wall
        row = f"| {name} | {variants} | {wall:.0f} | {wall / n:.1f} | {wall / first:.2f} | {variants:.0f} |"
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
