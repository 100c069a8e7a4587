"""What one Holm family costs the gate in a process that holds a model (where `gate=default` judges, right after the
run): statsmodels' multipletests(method="holm"), which runs a full garbage collection on every call, against
evalkit.stats.holm (the same decisions, tests/test_stats.py). CPU milliseconds per family.

    python benchmarks/holm_cost.py [--model smollm2-135m] [--calls 20]
"""

from __future__ import annotations

import argparse
import time
from importlib.resources import files

from omegaconf import OmegaConf
from statsmodels.stats.multitest import multipletests

from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.stats import adjust


def per_call(fn, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    p = [0.01, 0.04, 0.03, 0.005]
    rows = []
    for held in ("torch and transformers imported", args.model):
        if held == args.model:
            loaded = models.load(model_spec(OmegaConf.load(files("evalkit.conf") / "model" / f"{held}.yaml")), "cpu")
            assert loaded is not None
        sm = per_call(lambda: multipletests(p, alpha=0.05, method="holm"), args.calls)
        ek = per_call(lambda: adjust(p, 0.05, "holm"), args.calls)
        rows.append((held, sm, ek))
    print("| the process holds | statsmodels ms per family | evalkit ms per family |")
    print("|---|---:|---:|")
    for held, sm, ek in rows:
        print(f"| {held} | {sm:.1f} | {ek:.2f} |")


if __name__ == "__main__":
    main()
