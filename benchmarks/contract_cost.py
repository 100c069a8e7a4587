"""What the run-time policy contract (evalkit.contract) costs: the seconds spent in its checks, as a share of the
seconds of the runs they guard, on SmolLM2.

    python benchmarks/contract_cost.py [--lengths 1024 4096] [--samples 2]

Every check function is wrapped with a timer in this process, and the same run_sample calls are timed whole, so the
share is measured on the same work under the same load. The variants cover the kinds of check: a dense policy that
evicts once (snapkv), one that evicts after every decode step (h2o, decode=true: a check per generated token), a
layer-dependent budget (pyramidkv) and a ragged one (adakv(snapkv)).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

from omegaconf import OmegaConf

from evalkit import contract
from evalkit.cli.spec import model_spec
from evalkit.contract import policy as policy_module
from evalkit.engine import models
from evalkit.engine.engine import run_sample
from evalkit.kv.variant import Variant
from evalkit.policies import adakv, chunkkv
from evalkit.policies.adakv import AdaKV
from evalkit.policies.h2o import H2O
from evalkit.policies.pyramidkv import PyramidKV
from evalkit.policies.snapkv import SnapKV
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt

CONF = os.path.join(os.path.dirname(__file__), "..", "conf", "model", "smollm2-135m.yaml")
CHECKS = ("allowance", "check_indices", "check_layer", "check_held", "check_budgets")
spent = [0.0]  # seconds inside the checks


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    return wrapper


def instrument() -> None:
    """Wrap every check where it is looked up: evalkit.contract's functions, and checked_scores in the modules that
    call it (the base select, AdaKV, ChunkKV)."""
    for name in CHECKS:
        setattr(contract, name, timed(getattr(contract, name)))
    scores = timed(policy_module.checked_scores)
    for module in (policy_module, adakv, chunkkv):
        module.checked_scores = scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--samples", type=int, default=2)
    args = ap.parse_args()
    loaded = models.load(model_spec(OmegaConf.load(CONF)), "cpu")
    stop = {loaded.tokenizer.eos_token_id}
    variants = [
        Variant(SnapKV(budget=0.25)),
        Variant(H2O(budget=0.25, decode=True)),
        Variant(PyramidKV(budget=0.25)),
        Variant(AdaKV(inner=SnapKV(), budget=0.25)),
    ]
    instrument()
    print(f"variants: {', '.join(v.name for v in variants)}; {args.samples} samples per length")
    print(f"{'context':>8} {'run s/sample':>13} {'checks s/sample':>16} {'share':>7}")
    for length in args.lengths:
        task = NeedleTask(context_lengths=[length], depths=[0.5], samples_per_cell=args.samples)
        runs, checks = [], []
        for sample in task.samples(loaded.tokenizer):
            prompt = build_prompt(loaded.tokenizer, sample)
            spent[0] = 0.0
            t = time.perf_counter()
            run_sample(loaded.model, prompt, variants, task.max_new_tokens, stop)
            runs.append(time.perf_counter() - t)
            checks.append(spent[0])
        r, c = statistics.median(runs), statistics.median(checks)
        print(f"{length:>8} {r:>13.2f} {c:>16.4f} {c / r:>6.2%}")


if __name__ == "__main__":
    main()
