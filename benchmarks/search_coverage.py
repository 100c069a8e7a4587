"""A budget search's error rate and power by simulation, every draw judged by the gate's own `judge`
(evalkit.gate.judge: the rows as a run writes them, the search's chains, the fixed sequence within a policy and the
graphical procedure across policies, exactly as `python -m evalkit.gate` decides).

    nice -n 10 python benchmarks/search_coverage.py [--draws 300] [--draws4 100] [--only independent|clustered]
                                                    [--quick] [--seed 0]

Each policy is searched at five budgets (0.75, 0.5, 0.35, 0.25, 0.15) on the same n contexts, every context right
under the full cache. A context is lost at budget j when its latent u < loss_j. Drop shapes:

- `margin`: every budget exactly at the margin (a 5% loss, the drop at max_drop = 0.05): no budget is safe; each
  budget's losses drawn on their own (with one latent for all, five budgets at one rate would lose the same
  contexts, and five tests would be one);
- `crossing`: losses 0, 0, 1%, 5%, 10%, one latent per context for all budgets, so losses are nested (what a budget
  loses, every smaller one loses too: monotone, as real policies' are): the true safe budget is 0.35, the drop
  reaches the margin at 0.25.

Documents: one question each (independent), or `clustered`: documents of m = 5 questions whose latents share a
document effect (a Gaussian copula with latent correlation 0.3; each question's loss rate stays loss_j), judged with
the document as the unit, as the gate does. A false safe is a policy reported safe at a budget whose true drop is at
or beyond the margin; the rate is the share of draws with any false safe among the policies searched (the whole
search's error). Beside the search: "one run per budget, the smallest PASS taken" (each budget judged alone by the
same `judge`, at 5% each, the smallest budget that PASSes reported), what users did before the search. Power: the
share of draws whose reported safe budget is the true one (0.35), per policy, at the planner's n for a 1% loss
(`python -m evalkit.gate --plan`: 205 contexts; for 4 policies, at level 5%/4: evalkit.gate.power.betting_contexts).
Every rate is printed with its Monte Carlo standard error; `ok` is "not above 5% by more than two of them".
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import norm

from evalkit.gate import decide
from evalkit.gate.judge import judge
from evalkit.gate.power import betting_contexts
from evalkit.thresholds import Thresholds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests: rows as evalkit writes them, and the gate's judge
from tests.conftest import as_rows, as_written  # noqa: E402
from tests.test_gate import rows as paired_rows  # noqa: E402

T = Thresholds()
ALPHA = 1 - T.confidence
BUDGETS = (0.75, 0.5, 0.35, 0.25, 0.15)
SHAPES = {"margin": (0.05,) * 5, "crossing": (0.0, 0.0, 0.01, 0.05, 0.10)}
NESTED = {"margin": False, "crossing": True}
SEARCH = [{"run_id": "sim", "config": {"search": {"budgets": list(BUDGETS)}}}]
M, LATENT_CORR = 5, 0.3  # the clustered case: questions per document, latent correlation within one


def latents(rng: np.random.Generator, docs: int, m: int) -> np.ndarray:
    """Each question's latent in [0, 1] (uniform marginals), (docs, m): independent for m = 1, else a document effect
    shared by its questions (latent correlation LATENT_CORR)."""
    if m == 1:
        return rng.random((docs, 1))
    z = math.sqrt(LATENT_CORR) * rng.standard_normal((docs, 1)) + math.sqrt(1 - LATENT_CORR) * rng.standard_normal(
        (docs, m)
    )
    return norm.cdf(z)


def search_rows(u: np.ndarray, losses: tuple, policies: int) -> list[dict]:
    """Rows as a search run writes them: the baseline once, every policy at every budget on the same contexts; `u`
    (policies, budgets, docs, m) the questions' latents."""
    doc = np.repeat(np.arange(u.shape[2]), u.shape[3])
    out, seen = [], False
    for p in range(policies):
        for j, (b, loss) in enumerate(zip(BUDGETS, losses, strict=True)):
            scores = list((u[p, j].reshape(-1) >= loss).astype(float))
            for r in paired_rows([1.0] * len(scores), scores, variant=f"pol{p}@{b}", kv=(round(100 * b), 100)):
                if r["variant"] == "baseline" and seen:
                    continue
                out.append(r)
            seen = True
    for r in out:  # a document's questions share its id (and, query-agnostic, its prefilled context)
        d = f"{doc[int(r['sample_id'])]:08x}"
        r["document_id"], r["context_id"] = d, d
    return out


def searched(rows: list[dict], policies: int) -> list[int | None]:
    """Each policy's reported safe budget (its index in BUDGETS, None: none) by the search."""
    v = judge(as_rows(as_written(rows)), SEARCH, T, problems=[])
    found = v.search["policies"]
    return [None if found[f"pol{p}"]["safe_budget"] is None else BUDGETS.index(found[f"pol{p}"]["safe_budget"])
            for p in range(policies)]  # fmt: skip


def one_run_per_budget(rows: list[dict], policies: int) -> list[int | None]:
    """Each policy's smallest budget that PASSes when every budget is judged on its own (a run each: the baseline's
    rows and that variant's), the route users took before the search."""
    written = as_written(rows)
    base = [r for r in written if r["variant"] == "baseline"]
    out = []
    for p in range(policies):
        passed = [
            j for j, b in enumerate(BUDGETS)
            if judge(as_rows(base + [r for r in written if r["variant"] == f"pol{p}@{b}"]), [], T, problems=[]).status
            == "PASS"
        ]  # fmt: skip
        out.append(max(passed) if passed else None)
    return out


def rates(shape: str, policies: int, docs: int, m: int, draws: int, seed: int) -> dict[str, float]:
    """Over `draws` searches: the share with any false safe (search; one run per budget) and the share of policies
    reaching the true safe budget (search)."""
    losses = SHAPES[shape]
    margin = T.max_drop
    true_safe = max((j for j, x in enumerate(losses) if x < margin), default=None)
    rng = np.random.default_rng(seed)
    false_search = false_alone = reached = 0
    for _ in range(draws):
        if NESTED[shape]:  # one latent a question and policy: what a budget loses, every smaller one loses too
            u = np.stack([np.repeat(latents(rng, docs, m)[None], len(BUDGETS), axis=0) for _ in range(policies)])
        else:  # a latent a question, policy and budget: each budget's losses drawn on their own
            u = np.stack([np.stack([latents(rng, docs, m) for _ in BUDGETS]) for _ in range(policies)])
        rows = search_rows(u, losses, policies)
        found, alone = searched(rows, policies), one_run_per_budget(rows, policies)
        false_search += any(j is not None and losses[j] >= margin for j in found)
        false_alone += any(j is not None and losses[j] >= margin for j in alone)
        reached += sum(j == true_safe for j in found) if true_safe is not None else 0
    return {
        "search": false_search / draws,
        "alone": false_alone / draws,
        "power": reached / (draws * policies) if true_safe is not None else math.nan,
    }


def se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=300, help="draws a row with one policy")
    ap.add_argument("--draws4", type=int, default=100, help="draws a row with four policies (each judges 25 runs)")
    ap.add_argument("--quick", action="store_true", help="10 / 4 draws a row: the script runs, the rates mean little")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["independent", "clustered"], default=None)
    a = ap.parse_args(argv)
    per = {1: 10 if a.quick else a.draws, 4: 4 if a.quick else a.draws4}
    floor = decide.floor(T)
    n_for = {k: betting_contexts(T, floor, 0.01, 0.0, 0.8, variants=k) for k in (1, 4)}
    print(f"budgets {list(BUDGETS)}; margin max_drop={T.max_drop}; alpha {ALPHA:.3g}; {per[1]} / {per[4]} draws a row "
          f"(1 / 4 policies); the planner's n for a 1% loss at 80% power: {n_for[1]} (1 policy), {n_for[4]} "
          "(4 policies, level 5%/4)", flush=True)  # fmt: skip
    head = "| drops | documents | policies | n | false safe: search | false safe: one run per budget, smallest PASS | power: search reaches 0.35 |"  # noqa: E501
    print(head + "\n|---|---|---:|---:|---|---|---|")
    cases = []
    if a.only in (None, "independent"):
        cases += [(s, k, 1, 1) for k in (1, 4) for s in ("margin", "crossing")]
    if a.only in (None, "clustered"):
        cases += [(s, k, M, LATENT_CORR) for k in (1, 4) for s in ("margin", "crossing")]
    bad, t0 = 0, time.time()
    for i, (shape, k, m, corr) in enumerate(cases):
        docs = n_for[k] if m == 1 else math.ceil(n_for[k] / 2)  # documents of 5 questions: about 2 documents' worth
        draws = per[k]
        r = rates(shape, k, docs, m, draws, a.seed + i)
        ok = r["search"] <= ALPHA + 2 * se(r["search"], draws)
        bad += not ok
        unit = "1 question each" if m == 1 else f"{m} questions, latent corr {corr}"
        power = "-" if math.isnan(r["power"]) else f"{r['power']:.3f} +- {se(r['power'], draws * k):.3f}"
        found = f"{r['search']:.3f} +- {se(r['search'], draws):.3f} ({'ok' if ok else 'OVER'})"
        alone = f"{r['alone']:.3f} +- {se(r['alone'], draws):.3f}"
        print(f"| {shape} | {unit} | {k} | {docs} | {found} | {alone} | {power} |", flush=True)
    print(f"\n{time.time() - t0:.0f} s; rows over 5% + 2 MC errors: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
