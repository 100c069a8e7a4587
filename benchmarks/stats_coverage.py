"""The gate's error rates by simulation: how often a variant whose true drop sits exactly at the margin (or
whose loss rate sits at the flip limit) PASSes, and how often a variant at the planner's sample size does.

    nice -n 10 python benchmarks/stats_coverage.py [--draws 4000] [--quick] [--seed 0]
    nice -n 10 python benchmarks/stats_coverage.py --kl-tails --draws 2000   # KL tails, through evalkit.gate.judge

Contexts are drawn independently; within one, m questions share a random effect (a Dirichlet-multinomial with
intra-context correlation icc, evalkit.gate.power.draw_contexts). 0/1 scores, or graded ones (a loss or gain moves a
score by 0.1, or by 0.5). Every draw is judged by the gate's own decision at its default thresholds (the betting
test of evalkit.stats.betting that evalkit.gate.checks calls at every look, vectorised over draws;
tests/test_stats_coverage.py checks it against evalkit.gate.decide on single draws), at:

- one look at n contexts;
- the README's old sequence, 20 -> 60 -> 130 contexts with resume=true, stopping at the first PASS (a FAIL does not
  stop it: that only adds chances to PASS);
- the gate's own advice, from a first look at 20 or 59 contexts, up to 6 looks (advice over 2,000 contexts ends it);
- the routes that once re-judged for free (a section of their own, `routes`): looks deleted between 20 -> 60 -> 130
  (a fresh folder, a report's peek, a CI job), 10 contexts added fifteen times, the advice followed each time. Every
  look is judged afresh by betting, so these are the same sequences: the wealth over nested prefixes is one
  supermartingale.

Each row prints the PASS rate with its Monte Carlo standard error; `ok` is "the rate is not above 5% by more than
two standard errors". With one 0/1 question per context and one look the exact chance (enumeration over the
outcomes, evalkit.gate.power) is printed beside it. Then power: the share of PASSes at the sample size
`python -m evalkit.gate --plan` gives for 80% power.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.stats import binom

from evalkit.gate import decide
from evalkit.gate.checks import evaluate, kl_cap
from evalkit.gate.contexts import group
from evalkit.gate.power import betting_contexts, betting_power_counts, draw_contexts, kl_fail_contexts
from evalkit.records import Row, flip
from evalkit.stats import betting, binary_bounds
from evalkit.thresholds import Thresholds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests: rows as evalkit writes them, and the gate's judge
from tests.conftest import judge_rows  # noqa: E402
from tests.test_gate import rows as paired_rows  # noqa: E402

T = Thresholds()
ALPHA = 1 - T.confidence
FLOOR = decide.floor(T)
KMAX = 2000  # contexts a simulated run may grow to
LOOKS = 6
CHUNK = 250  # draws judged at once (memory: CHUNK x KMAX x bets)


@dataclass(frozen=True)
class Scenario:
    """Paired outcomes: per question lost (rate `loss`), gained (`gain`) or unchanged; a loss or gain moves the score
    by `step` (1: 0/1 scores); m questions per context, intra-context correlation icc."""

    loss: float
    gain: float
    m: int = 1
    icc: float = 0.0
    step: float = 1.0

    @property
    def scores(self) -> str:
        return "0/1" if self.step == 1 else f"graded {self.step}"

    @property
    def enumerable(self) -> bool:
        """One 0/1 question per context: the chance of a PASS at one look is a sum over outcomes."""
        return self.step == 1 and self.m == 1

    def draw(self, rng, draws: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Per context: (drop, share of questions lost), each (draws, k)."""
        lost, gained = draw_contexts(rng, draws, k, self.m, self.loss, self.gain, self.icc)
        drop = self.step * (lost - gained) / self.m
        flipped = lost / self.m if self.step > T.graded_flip_delta else np.zeros_like(drop)
        return drop, flipped


class Runs:
    """A chunk of simulated runs: every context they may grow to, with what the gate's tests need at any length."""

    def __init__(self, s: Scenario, drop: np.ndarray, flipped: np.ndarray):
        self.s = s
        self.checks = {
            "drop": self._sums(drop, T.max_drop, -1.0),
            "flips": self._sums(flipped, T.max_flip_rate, 0.0),
        }

    @staticmethod
    def _sums(x: np.ndarray, target: float, lo: float):
        logs = betting.log_factors(x, target, lo, 1.0, below=True)  # (draws, K, J)
        dead = np.cumsum(~np.isfinite(logs), axis=1) > 0
        safe = np.where(np.isfinite(logs), logs, 0.0)
        return np.cumsum(safe, axis=1), np.cumsum(safe * safe, axis=1), dead

    def wealth(self, what: str, n: np.ndarray) -> np.ndarray:
        total, _, dead = self.checks[what]
        rows = np.arange(len(n))
        w = np.where(dead[rows, n - 1], -np.inf, total[rows, n - 1])
        return betting.mix(w)

    def passes(self, n: np.ndarray) -> np.ndarray:
        """The gate's PASS (evalkit.gate.checks.evaluate) for each run at its length n, at any look."""
        ok = n >= FLOOR
        for what in ("drop", "flips"):
            ok &= self.wealth(what, n) >= math.log(1 / ALPHA)
        return ok

    def advice(self, n: np.ndarray) -> np.ndarray:
        """The contexts the gate advises (evalkit.gate.power.contexts_needed): inf where none follows."""
        rows = np.arange(len(n))
        need = np.zeros(len(n))
        for what in ("drop", "flips"):
            total, squares, dead = self.checks[what]
            g = total[rows, n - 1] / n[:, None]
            s = np.sqrt(np.maximum(squares[rows, n - 1] / n[:, None] - g * g, 0.0))
            need = np.maximum(need, betting.growth_to_show(g, s, ~dead[rows, n - 1], ALPHA, 0.8))
        return np.where(np.isfinite(need), np.maximum(np.maximum(np.ceil(need), FLOOR), n + 1), np.inf)


def simulate(s: Scenario, plan, draws: int, seed: int) -> float:
    """The share of runs that PASS at some look. plan: a list of look sizes, or ("advice", start)."""
    rng = np.random.default_rng(seed)
    kmax = max(plan) if plan[0] != "advice" else KMAX
    passed = 0
    for start in range(0, draws, CHUNK):
        size = min(CHUNK, draws - start)
        runs = Runs(s, *s.draw(rng, size, kmax))
        n = np.full(size, plan[0] if plan[0] != "advice" else plan[1], dtype=int)
        alive, done = np.ones(size, dtype=bool), np.zeros(size, dtype=bool)
        for look in range(LOOKS if plan[0] == "advice" else len(plan)):
            ok = runs.passes(n) & alive
            done |= ok
            alive &= ~ok
            if plan[0] == "advice":
                nxt = runs.advice(n)
                alive &= nxt <= kmax
                n = np.where(alive, np.minimum(nxt, kmax), n).astype(int)
            elif look + 1 < len(plan):
                n = np.full(size, plan[look + 1], dtype=int)
            if not alive.any():
                break
        passed += int(done.sum())
    return passed / draws


BINARY = [(0.05, 0.0), (0.07, 0.02), (0.09, 0.04), (0.10, 0.07)]  # the drop at the margin; the last: flips at 10%
GRADED = [(0.5, 0.0, 0.1), (0.6, 0.1, 0.1), (0.1, 0.0, 0.5)]  # (loss, gain, step): drop 0.05
CLUSTERS = [(1, 0.0), (5, 0.0), (5, 0.3), (5, 0.5), (10, 0.0), (10, 0.3), (10, 0.5)]


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [Scenario(0.05, 0.0, 10, 0.5), Scenario(0.07, 0.02, 5, 0.3), Scenario(0.5, 0.0, 5, 0.3, 0.1)]
    out = [Scenario(loss, gain, m, icc) for m, icc in CLUSTERS for loss, gain in BINARY]
    return out + [Scenario(loss, gain, m, icc, step) for m, icc in CLUSTERS for loss, gain, step in GRADED]


def plans(quick: bool) -> list[tuple]:
    if quick:
        return [(100,), (20, 60, 130), ("advice", 20)]
    return [(20,), (59,), (100,), (300,), (20, 60, 130), ("advice", 20), ("advice", 59)]


def describe(plan) -> str:
    if plan[0] == "advice":
        return f"advice from {plan[1]}, <= {LOOKS} looks"
    return " -> ".join(map(str, plan)) + (" (one look)" if len(plan) == 1 else "")


def exact_rate(s: Scenario, plan) -> float | None:
    """With one 0/1 question per context and one look: the chance of a PASS by enumeration (evalkit.gate.power)."""
    if not (s.enumerable and len(plan) == 1 and plan[0] != "advice"):
        return None
    return betting_power_counts(T, plan[0], ALPHA, s.loss, s.gain) if plan[0] >= FLOOR else 0.0


def error_rates(quick: bool, draws: int, seed: int):
    """One row per scenario and plan, as each is simulated."""
    for i, s in enumerate(scenarios(quick)):
        for j, plan in enumerate(plans(quick)):
            rate = simulate(s, plan, draws, seed + 1000 * i + j)
            se = math.sqrt(max(rate * (1 - rate), ALPHA * (1 - ALPHA)) / draws)  # at 5% where the rate is below it
            yield {"s": s, "plan": plan, "rate": rate, "se": se, "exact": exact_rate(s, plan)}


def power_rows(quick: bool, draws: int, seed: int) -> list[dict]:
    """PASS rates at the planner's n for 80% power: one 0/1 question per context (exact enumeration), the same after
    a pilot look of 20, and with 5 questions per context at icc 0.3 (Monte Carlo planner; simulated here with other
    seeds)."""
    cases = [("once", Scenario(0.01, 0.0))]
    if not quick:
        cases += [("once", Scenario(0.02, 0.0)), ("once", Scenario(0.02, 0.02)), ("again", Scenario(0.01, 0.0))]
        cases += [("once", Scenario(0.01, 0.0, 5, 0.3))]
    out = []
    for k, (how, s) in enumerate(cases):
        if how == "again":
            n = betting_contexts(T, FLOOR, s.loss, s.gain, 0.8)
            plan = (20, n)
        else:
            n = betting_contexts(T, FLOOR, s.loss, s.gain, 0.8, s.m, s.icc)
            plan = (n,)
        rate = simulate(s, plan, draws, seed + 7 + k)
        se = math.sqrt(rate * (1 - rate) / draws)
        out.append({"s": s, "plan": plan, "rate": rate, "se": se, "exact": exact_rate(s, plan)})
    return out


ROUTES = [(20, 60, 130), tuple(range(20, 171, 10)), ("advice", 20)]  # looks deleted; +10 fifteen times; the advice


def route_rows(quick: bool, draws: int, seed: int):
    """The routes that restarted the old exact first look on the same samples, at the margin (0/1 and one or five
    questions per context): every look is the betting test, so each is a run judged at several lengths."""
    cases = [Scenario(0.05, 0.0), Scenario(0.07, 0.02), Scenario(0.10, 0.07)]
    if quick:
        cases = cases[:1]
    else:
        cases += [Scenario(0.05, 0.0, 5, 0.3)]
    for i, s in enumerate(cases):
        for j, plan in enumerate(ROUTES):
            rate = simulate(s, plan, draws, seed + 5000 + 100 * i + j)
            se = math.sqrt(max(rate * (1 - rate), ALPHA * (1 - ALPHA)) / draws)
            yield {"s": s, "plan": plan, "rate": rate, "se": se}


def describe_route(plan) -> str:
    if plan[0] == "advice":
        return f"the advice followed from {plan[1]} ({LOOKS} looks)"
    if len(plan) > 3:
        return f"{plan[0]}, then +{plan[1] - plan[0]} {len(plan) - 1} times"
    return " -> ".join(map(str, plan)) + ", looks deleted"


def print_routes(quick: bool, draws: int, seed: int) -> int:
    """The routes section; returns the rows out of bounds."""
    print("\nroutes that once re-judged for free, at the margin (every look by betting)")
    bad = 0
    for r in route_rows(quick, draws, seed):
        s, ok = r["s"], r["rate"] <= ALPHA + 2 * r["se"]
        bad += not ok
        print(f"  {s.scores} m={s.m} icc={s.icc} loss {s.loss:.2f} gain {s.gain:.2f}: {describe_route(r['plan']):<40}"
              f"PASS rate {r['rate']:.4f} +- {r['se']:.4f}  {'yes' if ok else 'NO'}", flush=True)  # fmt: skip
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="the reduced grid CI runs")
    ap.add_argument("--documents", action="store_true", help="only the documents and KL section")
    ap.add_argument("--kl-tails", action="store_true", help="only the KL tails, judged by the gate's own judge")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.kl_tails:
        bad = kl_tail_table(args.draws, args.seed)
        print(f"\n{bad} rows out of bounds; {time.perf_counter() - t0:.0f} s")
        return 1 if bad else 0
    if args.documents:
        bad = document_table(args.draws, args.seed) + kl_table(args.draws, args.seed)
        print(f"\n{bad} rows out of bounds; {time.perf_counter() - t0:.0f} s")
        return 1 if bad else 0
    print(f"PASS rate at the margin (max_drop {T.max_drop}, max_flip_rate {T.max_flip_rate}, {T.confidence:.0%}), "
          f"{args.draws} draws per row")  # fmt: skip
    print(f"{'scores':<12}{'m':>3}{'icc':>5}{'loss':>6}{'gain':>6}  {'looks':<30}{'PASS rate':>10}{'+- MC se':>10}"
          f"{'exact':>8}  ok")  # fmt: skip
    bad = 0
    for r in error_rates(args.quick, args.draws, args.seed):
        s, ok = r["s"], r["rate"] <= ALPHA + 2 * r["se"]
        bad += not ok
        ex = "" if r["exact"] is None else f"{r['exact']:.4f}"
        print(f"{s.scores:<12}{s.m:>3}{s.icc:>5}{s.loss:>6}{s.gain:>6}  {describe(r['plan']):<30}{r['rate']:>10.4f}"
              f"{r['se']:>10.4f}{ex:>8}  {'yes' if ok else 'NO'}", flush=True)  # fmt: skip
    print("\npower at the planner's n for 80% (python -m evalkit.gate --plan)")
    for r in power_rows(args.quick, args.draws, args.seed):
        s = r["s"]
        ok = r["rate"] >= 0.8 - 2 * r["se"]
        bad += not ok
        ex = "" if r["exact"] is None else f" (exact {r['exact']:.4f})"
        print(
            f"  {s.scores} m={s.m} icc={s.icc} loss {s.loss:.2f} gain {s.gain:.2f}: looks {describe(r['plan'])}, "
            f"PASS rate {r['rate']:.4f} +- {r['se']:.4f}{ex}  {'yes' if ok else 'NO'}",
            flush=True,
        )
    bad += print_routes(args.quick, args.draws, args.seed)
    print(f"\n{bad} rows out of bounds; {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


# --- the document as the unit, and the KL as a bound (python benchmarks/stats_coverage.py --documents) ---------------

DOC_K = (6, 12, 30)  # documents, each with m questions
DOC_M = (5, 10)
DOC_ICC = (0.1, 0.3, 0.5)
PROTOCOLS = ("query_agnostic", "query_aware")


def document_rows(lost: np.ndarray, gained: np.ndarray, m: int, protocol: str) -> list[Row]:
    """A variant's paired rows as a run writes them: per document its lost and gained questions of m, every
    question naming its document; under query_aware each question also compresses its own context."""
    rows = []
    for d, (b, c) in enumerate(zip(lost, gained, strict=True)):
        outcomes = [(1.0, 0.0)] * int(b) + [(0.0, 1.0)] * int(c) + [(1.0, 1.0)] * (m - int(b) - int(c))
        for q, (base, pol) in enumerate(outcomes):
            context = f"{d:08x}{q:08x}" if protocol == "query_aware" else f"{d:016x}"
            ids = {"document_id": f"{d:016x}", "context_id": context}
            rows.append(
                Row("sim", "sim", protocol, f"{d}-{q}", {}, "v", pol, base, flip(pol, base), fields=ids)
            )  # fmt: skip
    return rows


def judged(rows: list[Row], t) -> tuple[bool, bool]:
    """(PASS, FAIL) of one variant by the gate's own judging code: its rows grouped (evalkit.gate.contexts.group),
    then the checks by betting (evalkit.gate.checks.evaluate)."""
    e = evaluate("v", group(rows, t.graded_flip_delta, kl_cap(t)), t, decide.floor(t))
    return e.p_pass <= 1 - t.confidence, any(c.p_broken <= 1 - t.confidence for c in e.checks)


def document_rate(k: int, m: int, icc: float, protocol: str, loss: float, draws: int, seed: int) -> float:
    """The share of runs of k documents x m questions (drop `loss`, none gained) that the gate PASSes."""
    rng = np.random.default_rng(seed)
    lost, gained = draw_contexts(rng, draws, k, m, loss, 0.0, icc)
    return float(np.mean([judged(document_rows(lost[i], gained[i], m, protocol), T)[0] for i in range(draws)]))


def document_table(draws: int, seed: int) -> int:
    """PASS rates at the margin (5% lost: the drop at max_drop) for K documents x m questions, both protocols, and
    power (a 1% loss) at the planner's count of documents; the number of rows out of bounds."""
    bad = 0
    print(f"\nthe document as the unit: PASS rate with the drop at the margin (5% lost), {draws} draws per row")
    print(f"{'m':>3}{'icc':>5}{'K':>6}  " + "".join(f"{p:>16}" for p in PROTOCOLS) + "   +- MC se  ok")
    for m in DOC_M:
        for icc in DOC_ICC:
            plan = betting_contexts(T, FLOOR, 0.01, 0.0, 0.8, m, icc)
            for i, k in enumerate((*DOC_K, plan)):
                rates = [document_rate(k, m, icc, p, 0.05, draws, seed + i) for p in PROTOCOLS]
                se = math.sqrt(max(max(rates) * (1 - max(rates)), ALPHA * (1 - ALPHA)) / draws)
                ok = max(rates) <= ALPHA + 2 * se
                bad += not ok
                print(f"{m:>3}{icc:>5}{k:>6}  " + "".join(f"{r:>16.4f}" for r in rates) + f"{se:>10.4f}  "
                      f"{'yes' if ok else 'NO'}")  # fmt: skip
            power = document_rate(plan, m, icc, "query_aware", 0.01, draws, seed + 99)
            se = math.sqrt(power * (1 - power) / draws)
            print(f"{'':>14}power at the planner's {plan} documents (1% lost): {power:.4f} +- {se:.4f}", flush=True)
    return bad


KL_N = (59, 100, 300, 1000)
KL_SHAPES = ("exponential", "3% at 3 nats", "1% at 10 nats")


def kl_values(rng, shape: str, mean: float, n: int) -> np.ndarray:
    """n rows' KL with the given mean: exponential, or a share of rows at a fixed large KL and the rest exponential
    with what is left of the mean (a heavy tail: 3% of rows at 3 nats)."""
    if shape == "exponential":
        return rng.exponential(mean, n)
    share, at = {"3% at 3 nats": (0.03, 3.0), "1% at 10 nats": (0.01, 10.0)}[shape]
    tail = rng.random(n) < share
    rest = max(mean - share * at, 0.0) / (1 - share)
    return np.where(tail, at, rng.exponential(rest, n) if rest > 0 else 0.0)


def kl_table(draws: int, seed: int) -> int:
    """PASS and FAIL rates of the KL check alone (drop and flips off) at 1x and 2x max_mean_kl, one question per
    document, judged by betting; the number of rows out of bounds (a PASS rate at 1x, the true mean at the limit,
    above 5% + 2 MC errors)."""
    t = replace(T, max_drop=None, max_flip_rate=None)
    cap = kl_cap(t)
    bad = 0
    print(f"\nthe KL: PASS / FAIL rates of max_mean_kl={t.max_mean_kl} (rows capped at {cap:g} nats), {draws} draws")
    print(f"{'shape':<16}{'x limit':>8}{'capped':>8}" + "".join(f"{n:>16}" for n in KL_N) + "  ok")
    for i, shape in enumerate(KL_SHAPES):
        for times in (1, 2):
            rng = np.random.default_rng(seed + 10 * i + times)
            mean = times * t.max_mean_kl
            big = kl_values(rng, shape, mean, 200_000)
            capped = float(np.minimum(big, cap).mean())
            cells, worst = [], 0.0
            for n in KL_N:
                out = np.array([judged(_kl_rows(kl_values(rng, shape, mean, n)), t) for _ in range(draws)])
                rate, fail = out.mean(axis=0)
                worst = max(worst, rate)
                cells.append(f"{rate:.3f} / {fail:.3f}")
            se = math.sqrt(max(worst * (1 - worst), ALPHA * (1 - ALPHA)) / draws)
            ok = times == 2 or worst <= ALPHA + 2 * se  # at the limit (the true mean, not the capped one)
            bad += not ok
            print(f"{shape:<16}{times:>8}{capped:>8.3f}" + "".join(f"{c:>16}" for c in cells) +
                  f"  {'yes' if ok else 'NO'}", flush=True)  # fmt: skip
    return bad


# --- KL tails above the cap, through the gate's own judge (python benchmarks/stats_coverage.py --kl-tails) ------------


@dataclass(frozen=True)
class Tail:
    """One question per document: a share of rows at `at` nats, the rest at `rest` (every row alike): the gate's
    verdict depends on the number of tail rows alone, so each count drawn is judged once and its verdict reused."""

    share: float
    at: float
    rest: float

    @property
    def mean(self) -> float:
        return self.share * self.at + (1 - self.share) * self.rest

    def kl(self, n: int, k: int) -> list[float]:
        return [self.at] * k + [self.rest] * (n - k)


def at_twice(share: float, at: float) -> Tail:
    """The tail with the rest raised so that the mean KL is twice max_mean_kl."""
    return Tail(share, at, (2 * T.max_mean_kl - share * at) / (1 - share))


# The tails with a true mean KL at max_mean_kl (0.1): wrong PASSes where the tail's share is at
# max_kl_tail_share (0.01), right ones (of what the gate bounds) where it is below
TAILS = (Tail(0.01, 10.0, 0.0), Tail(0.005, 20.0, 0.0), Tail(0.002, 50.0, 0.0), Tail(0.01, 5.0, 0.05))
TWICE = (Tail(0.06, 3.0, (0.2 - 0.18) / 0.94), *(at_twice(x.share, x.at) for x in TAILS))


class Judged:
    """The gate's status of a Tail run of n documents with k tail rows, by evalkit.gate.judge.judge (memoised)."""

    def __init__(self, tail: Tail, t=T):
        self.tail, self.t, self.seen = tail, t, {}

    def __call__(self, n: int, k: int) -> str:
        if (n, k) not in self.seen:
            kl = self.tail.kl(n, k)
            rows = [
                {**r, "kl_mean": 0.0 if r["variant"] == "baseline" else kl[int(r["sample_id"])]}
                for r in paired_rows([1] * n, [1] * n)
            ]
            self.seen[n, k] = judge_rows(rows, [], self.t).status
        return self.seen[n, k]

    def rate(self, n: int, status: str, draws: int, seed: int) -> tuple[float, float, float]:
        """(share of `draws` seeded runs judged `status`, its Monte Carlo standard error, the exact chance: the sum
        over the tail counts that judge() gives that status, each weighed by its binomial chance)."""
        ks = np.random.default_rng(seed).binomial(n, self.tail.share, draws)
        rate = float(np.mean([self(n, int(k)) == status for k in ks]))
        top = int(binom.ppf(1 - 1e-9, n, self.tail.share))
        exact = sum(float(binom.pmf(k, n, self.tail.share)) for k in range(top + 1) if self(n, k) == status)
        return rate, math.sqrt(max(rate * (1 - rate), ALPHA * (1 - ALPHA)) / draws), exact

    def edge(self, n: int, status: str) -> int:
        """Where the verdict turns, by bisection over the tail count: the largest judged PASS (status PASS; -1 where
        none is) or the smallest judged FAIL (n + 1 where none is). More tail rows never make a PASS easier nor a FAIL
        harder (each moves every bet's wealth one way), so a caller may count the draws on either side (the tests,
        which judge the counts beside the edge too)."""
        lo, hi = (-1, n) if status == "PASS" else (0, n + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (self(n, mid) == status) == (status == "PASS"):
                lo = mid
            else:
                hi = mid
        return lo if status == "PASS" else hi

    def first_pass(self) -> int:
        """The fewest documents at which a run that drew no tail row PASSes (the verdict is monotone in n)."""
        lo, hi = 1, 4096
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self(mid, 0) == "PASS" else (mid + 1, hi)
        return lo


KL_TAIL_N = (112, 225, 378, 1000)  # the old gate's first PASS with the rest at 0, and at 0.05; the new one's at 0


def kl_tail_table(draws: int, seed: int) -> int:
    """PASS rates of the issue's KL tails at the limit, at n including the first n at which the rest PASS, and FAIL
    rates at twice the limit at the planner's n; the rows out of bounds (a wrong PASS above 5% + 2 MC errors where
    the tail's share is at max_kl_tail_share, FAIL power below 80% - 2 MC errors at the planner's n)."""
    bad, fail_n = 0, kl_fail_contexts(T)
    print(
        f"\nKL tails (max_mean_kl={T.max_mean_kl}, cap {kl_cap(T):g} nats, max_kl_tail_share={T.max_kl_tail_share}), "
        f"judged by evalkit.gate.judge.judge, {draws} draws: PASS rate +- MC se (exact)"
    )
    for i, tail in enumerate(TAILS):
        judged_ = Judged(tail)
        first = judged_.first_pass()
        for n in sorted({*KL_TAIL_N, first}):
            rate, se, exact = judged_.rate(n, "PASS", draws, seed + 100 * i + n)
            wrong = tail.share >= T.max_kl_tail_share
            ok = not wrong or rate <= ALPHA + 2 * se
            bad += not ok
            print(f"  {tail.share:.1%} at {tail.at:g} nats, rest {tail.rest:g} (mean {tail.mean:.3f}), n={n:>5}"
                  f"{' (first PASS of the rest)' if n == first else '':<26}: {rate:.4f} +- {se:.4f} ({exact:.4f})"
                  f"{'  [share at the limit]' if wrong else ''}  {'yes' if ok else 'NO'}", flush=True)  # fmt: skip
    print(f"FAIL at twice the limit, at the planner's n ({fail_n}) and 1000: FAIL rate +- MC se (exact)")
    for i, tail in enumerate(TWICE):
        judged_ = Judged(tail)
        for n in (fail_n, 1000):
            rate, se, exact = judged_.rate(n, "FAIL", draws, seed + 7000 + 100 * i + n)
            ok = n != fail_n or tail.at > kl_cap(T) or rate >= 0.8 - 2 * se
            bad += not ok
            print(f"  {tail.share:.1%} at {tail.at:g} nats, rest {tail.rest:.4f} (mean {tail.mean:.3f}), n={n:>5}: "
                  f"{rate:.4f} +- {se:.4f} ({exact:.4f})  {'yes' if ok else 'NO'}", flush=True)  # fmt: skip
    return bad


def _kl_rows(kl: np.ndarray) -> list[dict]:
    return [{"score": 1.0, "baseline_score": 1.0, "document_id": str(i), "kl_mean": float(x)} for i, x in enumerate(kl)]


def coverage(p_lost: float, p_gained: float, n: int, draws: int, seed: int = 0) -> tuple[float, float, float]:
    """(upper at 95%, lower at 95%, two-sided 95%) coverage of the true drop p_lost - p_gained by Tango's bounds with
    the exact floor (per-sample figures)."""
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [p_lost, p_gained, 1 - p_lost - p_gained], size=draws)[:, :2]
    truth = p_lost - p_gained
    one = lru_cache(maxsize=None)(lambda b, c: binary_bounds(b, c, n, 0.95))
    two = lru_cache(maxsize=None)(lambda b, c: binary_bounds(b, c, n, 0.975))
    up = np.mean([one(int(b), int(c))[1] >= truth - 1e-12 for b, c in counts])
    lo = np.mean([one(int(b), int(c))[0] <= truth + 1e-12 for b, c in counts])
    both = np.mean([two(int(b), int(c))[0] <= truth + 1e-12 <= two(int(b), int(c))[1] + 2e-12 for b, c in counts])
    return float(up), float(lo), float(both)


if __name__ == "__main__":
    raise SystemExit(main())
