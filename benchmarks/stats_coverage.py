"""Coverage of the gate's intervals by simulation (issue 13): paired 0/1 data drawn at true loss and gain rates,
and the share of seeded draws whose bounds hold the true drop.

    python benchmarks/stats_coverage.py [--draws 2000]

Prints, per (loss rate, gain rate, n), the coverage of the one-sided 95% upper bound (what a PASS relies on), of
the one-sided 95% lower bound (what a FAIL relies on), and of the two-sided 95% interval (bounds at 0.975 each).
"""

from __future__ import annotations

import argparse
import time
from functools import lru_cache

import numpy as np

from evalkit.stats import binary_bounds

RATES = [(0.0, 0.0), (0.02, 0.0), (0.05, 0.0), (0.05, 0.02), (0.10, 0.05), (0.20, 0.0), (0.30, 0.10)]
SIZES = [10, 20, 59, 200]


def coverage(p_lost: float, p_gained: float, n: int, draws: int, seed: int = 0) -> tuple[float, float, float]:
    """(upper at 95%, lower at 95%, two-sided 95%) coverage of the true drop p_lost - p_gained."""
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [p_lost, p_gained, 1 - p_lost - p_gained], size=draws)[:, :2]
    truth = p_lost - p_gained
    one = lru_cache(maxsize=None)(lambda b, c: binary_bounds(b, c, n, 0.95))
    two = lru_cache(maxsize=None)(lambda b, c: binary_bounds(b, c, n, 0.975))
    up = np.mean([one(int(b), int(c))[1] >= truth - 1e-12 for b, c in counts])
    lo = np.mean([one(int(b), int(c))[0] <= truth + 1e-12 for b, c in counts])
    both = np.mean([two(int(b), int(c))[0] <= truth + 1e-12 <= two(int(b), int(c))[1] + 2e-12 for b, c in counts])
    return float(up), float(lo), float(both)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=2000)
    args = ap.parse_args()
    t = time.perf_counter()
    print(f"{'loss':>6}{'gain':>6}{'n':>6}{'upper 95%':>11}{'lower 95%':>11}{'two-sided 95%':>15}")
    worst = 1.0
    for p_lost, p_gained in RATES:
        for n in SIZES:
            up, lo, both = coverage(p_lost, p_gained, n, args.draws)
            worst = min(worst, up, lo, both)
            print(f"{p_lost:>6.2f}{p_gained:>6.2f}{n:>6}{up:>11.4f}{lo:>11.4f}{both:>15.4f}")
    print(f"lowest coverage: {worst:.4f} ({args.draws} draws per cell, {time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
