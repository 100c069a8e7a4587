"""Stakes that adapt to the outcomes seen so far: a design study for the gate's betting test (a benchmark; the
package is unchanged).

The gate shows "mean < target" for per-context values in [lo, hi] by betting (evalkit.stats.betting): the wealth
prod_i (1 + lam_i (target - x_i)) is a test supermartingale under H0: mean >= target whenever each lam_i lies in
[0, 1 / (hi - target)] and depends on x_1..x_{i-1} only (predictable), so by Ville's inequality it EVER reaches 20
with chance at most 5%. Today's lam is a fixed mixture of four constants (order-invariant). Here:

- `today`: evalkit's mixture (betting.log_factors / betting.mix), judged at the look's n (what the gate does);
- `today-max`: the same wealth, a PASS when any prefix of the fixed order reached 20 (the running maximum);
- `kelly(a, p0, c)`: a predictable Kelly plug-in: the log-optimal stake for the empirical distribution of values
  1..t-1 plus `a` pseudo-contexts (a share p0 of them at hi, the rest at 0: "a loss rate p0 seen a times"), at most
  c of the cap; judged by the running maximum;
- `agrapa(c)`: the approximate GRAPA plug-in of Waudby-Smith & Ramdas (2024, JRSS-B 86:1-27, section 5),
  (target - mu) / (var + (target - mu)^2) from a lightly regularised running mean and variance, at most c of the cap;
- `mix`: the average of two Kelly plug-ins' wealths (an average of test supermartingales is one).

Every candidate is judged on both checks of a one-question context: the drop (values -1, 0, 1, target 0.05) and
the flip rate (values 0, 1, target 0.10); a PASS needs both. Power: the first n whose PASS share over Monte Carlo
runs reaches 80% (the gate's planner reads the same for `today`: 74 / 134 / 205 / 484 / 258, exact). Error at a
margin: the share of runs that EVER PASS up to n = 2000, which bounds every pattern of looks over prefixes of one
order (kept, deleted, advised: each is a stopping time). MC standard errors are printed beside every rate.

The order these tests need. A predictable stake (and the running-maximum verdict) makes the wealth a function of
the ORDER of the values; Ville's bound holds for one fixed sequence judged at nested prefixes, under H0 that every
value's conditional mean given the earlier ones is >= target. So the order must (1) be fixed before any outcome is
seen and independent of the outcomes, and (2) only ever grow by appending. For evalkit: the rank of each sample in
the task's seeded draw order (tasks/hf.py `_subset`: the first k of random.Random(seed).shuffle(range(n)), nested
as the limit grows) meets both. The order rows are written to samples.jsonl does not: `_subset` returns
sorted(order[:k]) (dataset order, which may be sorted by subtask or length; with k == n there is no shuffle at
all), rows are flushed as each sample finishes (completion time can depend on the outcome), and an extension's new
rows interleave with the old ones in dataset order. What breaks: reordering rows (sorting by id, by cell, by
completion time) gives another supermartingale per order; judging whichever order is most favourable, or one order
per look, is several tests (the error is no longer bounded by 5%); several run folders judged together need one
fixed concatenation (first run first, a later folder appended) that no look reorders; two folders of the same
samples must not be judged as if independent. Today's constant mixture needs none of this (its wealth depends
only on the counts of values).

    python benchmarks/betting_stakes.py [--quick] [--draws N] [--seed S]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from evalkit.stats import betting

ALPHA = 0.05
NEED = math.log(1 / ALPHA)
DROP = (0.05, -1.0, 1.0, (-1.0, 0.0, 1.0))  # target, lo, hi, the values a one-question context can take
FLIP = (0.10, 0.0, 1.0, (0.0, 1.0))
POWER_RATES = ((0.0, 0.0), (0.005, 0.0), (0.01, 0.0), (0.02, 0.0), (0.02, 0.02))
MARGIN_RATES = ((0.05, 0.0), (0.075, 0.025), (0.10, 0.06))  # drop at 0.05; drop at 0.05; flip rate at 0.10


class Today:
    """evalkit's constant mixture: the wealth does not depend on the order (its log factors come from the package)."""

    def __init__(self, running_max: bool):
        self.running_max = running_max
        self.name = "today-max" if running_max else "today"
        self.parts = 1

    def start(self, n: int, check) -> np.ndarray:
        return np.zeros((n, len(betting.BETS)))

    def step(self, logs: np.ndarray, counts: np.ndarray, x: np.ndarray, check) -> np.ndarray:
        target, lo, hi, _ = check
        return logs + betting.log_factors(x, target, lo, hi, True)

    def log_wealth(self, logs: np.ndarray) -> np.ndarray:
        return betting.mix(logs)


def kelly_fraction(values, weights, target: float, cap: float) -> np.ndarray:
    """The stake lam in [0, cap] maximising sum_k w_k log(1 + lam g_k), g_k = target - v_k (weights (N, K) over two or
    three values): the root of sum_k w_k g_k / (1 + lam g_k), which falls with lam; times prod_j (1 + lam g_j) it is
    a polynomial of degree K - 1, solved in closed form (0 where it is <= 0 at 0, cap where it is >= 0 at cap)."""
    g = target - np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    c0 = w @ g
    if g.size == 2:
        lam = -c0 / (w.sum(axis=1) * g[0] * g[1])
    elif g.size == 3:
        pair = np.array([g[1] + g[2], g[0] + g[2], g[0] + g[1]])
        a2, b1 = w.sum(axis=1) * g.prod(), w @ (g * pair)
        disc = np.sqrt(np.maximum(b1 * b1 - 4 * a2 * c0, 0.0))
        with np.errstate(divide="ignore", invalid="ignore"):
            roots = np.stack([(-b1 - disc) / (2 * a2), (-b1 + disc) / (2 * a2)], axis=1)
        inside = (roots >= 0) & (roots <= cap)
        lam = np.where(inside, roots, np.inf).min(axis=1)
    else:
        raise ValueError("two or three values")
    at_cap = (w * g / (1.0 + cap * g)).sum(axis=1) >= 0
    return np.where(c0 <= 0, 0.0, np.where(at_cap, cap, np.clip(np.nan_to_num(lam, posinf=cap), 0.0, cap)))


class Plugin:
    """Predictable plug-in stakes, one or several (their wealths averaged): each step's stake uses the counts of the
    values seen before it only, and the verdict is the running maximum of the wealth over prefixes of the order."""

    def __init__(self, name: str, rules):
        self.name, self.rules, self.running_max, self.parts = name, rules, True, len(rules)

    def start(self, n: int, check) -> np.ndarray:
        return np.zeros((n, len(self.rules)))

    def stakes(self, counts: np.ndarray, check) -> np.ndarray:
        target, lo, hi, values = check
        cap = 1.0 / (hi - target)
        cols = []
        for kind, a, p0, c in self.rules:
            if kind == "kelly":  # a pseudo-contexts: a share p0 at hi, the rest at the value 0 ("nothing changed")
                prior = np.array([a * p0 if v == hi else (a * (1 - p0) if v == 0 else 0.0) for v in values])
                cols.append(kelly_fraction(values, counts + prior, target, c * cap))
            else:  # aGRAPA: regularised mean and variance (a pseudo-contexts at 0 with variance p0)
                v = np.asarray(values)
                n = counts.sum(axis=1) + a
                mu = (counts @ v) / n
                var = np.maximum((counts @ (v * v) + a * p0) / n - mu * mu, 1e-6)
                d = target - mu
                cols.append(np.clip(d / (var + d * d), 0.0, c * cap))
        return np.stack(cols, axis=1)

    def step(self, logs: np.ndarray, counts: np.ndarray, x: np.ndarray, check) -> np.ndarray:
        lam = self.stakes(counts, check)  # from values 1..t-1: counts is updated after this step
        target = check[0]
        with np.errstate(divide="ignore"):
            return logs + np.log(np.maximum(1.0 + lam * (target - x)[:, None], 0.0))

    def log_wealth(self, logs: np.ndarray) -> np.ndarray:
        return betting.mix(logs)


def candidates() -> list:
    """The tests compared: today's, today's judged by its running maximum, and predictable plug-ins."""
    return [
        Today(running_max=False),
        Today(running_max=True),
        Plugin("agrapa c=.9", [("agrapa", 2.0, 0.0, 0.9)]),
        Plugin("kelly a=200 p0=.005 c=.9", [("kelly", 200.0, 0.005, 0.9)]),
        Plugin("kelly a=400 p0=.01 c=.9", [("kelly", 400.0, 0.01, 0.9)]),
        Plugin("kelly a=400 p0=.002 c=.9", [("kelly", 400.0, 0.002, 0.9)]),
        Plugin("mix kelly(400,.002)+(100,.01)", [("kelly", 400.0, 0.002, 0.9), ("kelly", 100.0, 0.01, 0.9)]),
    ]


def simulate(tests, p_lost: float, p_gained: float, draws: int, length: int, seed: int):
    """One Monte Carlo scenario, every test on the same draws (one question a context, drop -1/0/1, flip 0/1):
    per test, the PASS share at each n (L,), and per run whether it ever PASSed and whether each check ever
    reached 1 / alpha by `length`."""
    rng = np.random.default_rng(seed)
    checks = (DROP, FLIP)
    counts = [np.zeros((draws, len(c[3]))) for c in checks]
    logs = [[t.start(draws, c) for c in checks] for t in tests]
    hit = [[np.zeros(draws, dtype=bool) for _ in checks] for _ in tests]
    ever = [np.zeros(draws, dtype=bool) for _ in tests]
    share = np.zeros((len(tests), length))
    for i in range(length):
        u = rng.random(draws)
        drop = np.where(u < p_lost, 1.0, np.where(u < p_lost + p_gained, -1.0, 0.0))
        xs = (drop, (drop > 0).astype(float))
        for j, t in enumerate(tests):
            now = []
            for k, c in enumerate(checks):
                logs[j][k] = t.step(logs[j][k], counts[k], xs[k], c)
                up = t.log_wealth(logs[j][k]) >= NEED - 1e-9
                hit[j][k] |= up
                now.append(hit[j][k] if t.running_max else up)
            passed = now[0] & now[1]
            ever[j] |= passed
            share[j, i] = passed.mean()
        for k, c in enumerate(checks):  # the values seen now enter the counts the next stake uses
            counts[k] += xs[k][:, None] == np.asarray(c[3])[None, :]
    return share, ever, hit


def first_at(share: np.ndarray, power: float = 0.8):
    """The first n whose PASS share reaches `power`, with that share (None past the simulated length)."""
    hit = np.nonzero(share >= power)[0]
    return (int(hit[0]) + 1, float(share[hit[0]])) if hit.size else (None, float(share[-1]))


def se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def power_table(tests, draws: int, length: int, seed: int) -> list[list[str]]:
    """Contexts for 80% power at each loss/gain rate: 'n (share +- MC error)' per test."""
    cells = [[t.name] for t in tests]
    for r, (p_lost, p_gained) in enumerate(POWER_RATES):
        share, _, _ = simulate(tests, p_lost, p_gained, draws, length, seed + r)
        for j in range(len(tests)):
            n, s = first_at(share[j])
            cells[j].append(f">{length}" if n is None else f"{n} ({s:.3f}+-{se(s, draws):.3f})")
    return cells


def margin_table(tests, draws: int, length: int, seed: int) -> list[list[str]]:
    """At each margin: the share of runs that EVER PASS by `length` and the share whose check at its margin ever
    reaches 1 / alpha (drop for the first two rates, flip rate for the third), each +- its MC error."""
    cells = [[t.name] for t in tests]
    for r, (p_lost, p_gained) in enumerate(MARGIN_RATES):
        _, ever, hit = simulate(tests, p_lost, p_gained, draws, length, seed + 100 + r)
        at = 1 if r == 2 else 0
        for j in range(len(tests)):
            e, h = float(ever[j].mean()), float(hit[j][at].mean())
            cells[j].append(f"{e:.4f}+-{se(e, draws):.4f} / {h:.4f}+-{se(h, draws):.4f}")
    return cells


def show(head: list[str], rows: list[list[str]]) -> None:
    wide = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    for row in [head, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, wide, strict=True)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer draws and shorter runs (under 30 s)")
    ap.add_argument("--draws", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    draws = a.draws or (600 if a.quick else 4000)
    p_len, m_len = (300, 400) if a.quick else (700, 2000)
    tests, t0 = candidates(), time.time()
    print(f"one 0/1 question a context; drop target 0.05 in [-1, 1], flip target 0.10; alpha {ALPHA}; {draws} draws")
    print(f"\ncontexts for 80% power (first n whose PASS share >= 0.8; share +- MC error at that n), n <= {p_len}:")
    head = ["test"] + [f"loss {pl:.1%} gain {pg:.1%}" for pl, pg in POWER_RATES]
    show(head, power_table(tests, draws, p_len, a.seed))
    print(f"\nerror at the margin, judged at every n <= {m_len}: P(ever PASS) / P(the check at its margin ever >= 20):")
    head = ["test"] + [f"loss {pl:.1%} gain {pg:.1%}" for pl, pg in MARGIN_RATES]
    show(head, margin_table(tests, draws, m_len, a.seed))
    print(f"\n{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
