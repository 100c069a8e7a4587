"""Error rates that hold: the context as the unit, looks that spend error rate, graded and KL bounds,
defaults enforced, one p-value per variant, sample sizes by power.

Expected values are derived here by hand (binomial sums with math.comb, the betting construction's closed form) or
taken from an independent review of the statistics, never from the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from evalkit.cli.gate import main
from evalkit.gate.power import kl_fail_contexts
from evalkit.thresholds import Thresholds
from tests.conftest import judge_rows
from tests.test_gate import rows
from tests.test_stats_coverage import bench_module

THETAS = (1, 0.8, 0.6, 0.4)  # evalkit.stats.betting's bets, weighted 1/4 each


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Bin(n, p), summed term by term."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def mixture_wealth(n: int, gain: float, margin: float = 0.05, hi: float = 1.0) -> float:
    """The betting test's wealth after n contexts that each gain `gain` on the bet (margin - value), by hand:
    sum_j w_j (1 + theta_j gain / (hi - margin))^n, theta = 1, 0.8, 0.6, 0.4, w = 1/4."""
    return sum(0.25 * (1 + th * gain / (hi - margin)) ** n for th in THETAS)


# --- five worked cases, each with the verdict the statistics call for ---


def above_wealth(lost: int, n: int, target: float, lo: float = -1.0) -> float:
    """By hand: the mixture wealth of the bet "mean above target" on n 0/1-lost contexts, `lost` of them at 1: each
    value x multiplies a bet theta's wealth by 1 + theta (x - target) / (target - lo)."""
    room = target - lo
    return sum(0.25 * (1 + th * (1 - target) / room) ** lost * (1 - th * target / room) ** (n - lost) for th in THETAS)


def test_six_lost_none_gained_of_59_is_inconclusive_not_fail():
    # the drop is 6/59 = 0.10, but 59 contexts do not show it above the 0.05 margin: by hand the betting wealth of
    # "above 0.05" is below 40 (Holm's first step over the drop's and the flip rate's claims), so no FAIL
    assert above_wealth(6, 59, 0.05) < 40
    v = judge_rows(rows([1] * 59, [0] * 6 + [1] * 53), [], Thresholds())
    assert v.status == "INCONCLUSIVE", v.reasons
    drop = v.variants["snapkv@0.25"]["gate"]["checks"]["drop"]
    assert drop["p_broken"] == pytest.approx(1 / above_wealth(6, 59, 0.05), rel=1e-9)
    # the printed lower bound agrees: the largest target the bet "above" still rejects at 5%
    assert above_wealth(6, 59, drop["bounds"][0] - 1e-6) >= 20 > above_wealth(6, 59, drop["bounds"][0] + 1e-3)
    # a clear regression is shown: 15 lost of 59 reach a wealth over 40 (a FAIL claims that one check is broken: the
    # claims of the drop and the flip rate are corrected together, Holm over 2)
    assert above_wealth(15, 59, 0.05) > 40
    assert judge_rows(rows([1] * 59, [0] * 15 + [1] * 44), [], Thresholds()).status == "FAIL"


def test_thirty_samples_with_five_gains_are_not_a_pass_at_the_default_min_samples():
    # today decide read `min_samples or 0`: 0 lost and 5 gained of 30 passed. Null means the count a lossless PASS
    # needs by betting: 74 (mixture_wealth(73) < 20 <= mixture_wealth(74))
    assert mixture_wealth(73, 0.05) < 20 <= mixture_wealth(74, 0.05)
    assert 0.95**59 < 0.05 < 0.95**58
    v = judge_rows(rows([0] * 5 + [1] * 25, [1] * 30), [], Thresholds())
    assert v.status == "INCONCLUSIVE"
    assert "30 samples, fewer than gate.min_samples=74" in "\n".join(v.reasons)
    # with min_samples=30 (and no flip limit, which 30 lossless contexts cannot show) the drop decides: 25 unchanged
    # contexts gain 0.05 on the bet, 5 gained ones 1.05, by hand a wealth far over 20
    gained = sum(0.25 * (1 + th * 0.05 / 0.95) ** 25 * (1 + th * 1.05 / 0.95) ** 5 for th in THETAS)
    assert gained > 20
    t = Thresholds(min_samples=30, max_flip_rate=None)
    assert judge_rows(rows([0] * 5 + [1] * 25, [1] * 30), [], t).status == "PASS"


def pass_chance(n: int, loss: float) -> float:
    """By hand: the chance that n one-question contexts, each lost with chance `loss` (none gained), PASS by betting:
    the sum of Bin(n, loss) over the lost counts b whose drop wealth (the margin 0.05) and flip wealth (0.10) both
    reach 20 (a loss multiplies a bet theta by 1 - theta, resp. 1 - theta 0.9 / 0.9)."""

    def wealth(b: int, target: float) -> float:
        room = 1 - target
        return sum(0.25 * (1 - th * (1 - target) / room) ** b * (1 + th * target / room) ** (n - b) for th in THETAS)

    ok = [b for b in range(n + 1) if wealth(b, 0.05) >= 20 and wealth(b, 0.10) >= 20]
    return sum(math.comb(n, b) * loss**b * (1 - loss) ** (n - b) for b in ok)


def test_plan_at_one_percent_loss_asks_for_the_samples_of_80_and_90_percent_power(capsys):
    # every look is the betting test: at a 1% loss rate 80% power needs 205 samples, 90% needs 239 (a test judged
    # once at a fixed count needed 124 and 153: the price of judging at any look), each checked by hand here
    assert main(["--plan", "--loss", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "loss rate  1.0%, gain rate  0.0%: 205 / 239 samples" in out
    assert pass_chance(205, 0.01) >= 0.8 and max(pass_chance(n, 0.01) for n in range(180, 205)) < 0.8
    assert pass_chance(239, 0.01) >= 0.9 and max(pass_chance(n, 0.01) for n in range(215, 239)) < 0.9


def test_the_clustered_case_does_not_pass():
    # 20 one-question documents with 6 lost, plus 300 questions on one more document that both answer right. Counted
    # as 320 independent samples it PASSed at drop +0.02 [+0.01, +0.04]; it is 21 contexts, 6 of them lost.
    docs = rows([1] * 20, [0] * 6 + [1] * 14)
    for r in docs:
        r["context_id"] = f"doc{r['sample_id']}"
    big = rows([1] * 300, [1] * 300)
    for r in big:
        r["sample_id"], r["context_id"] = f"q{r['sample_id']}", "doc-big"
    v = judge_rows(docs + big, [], Thresholds())
    assert v.status != "PASS", v.reasons
    assert "6 lost and 0 gained of 320 questions on 21 contexts" in "\n".join(v.reasons)
    # the contrast: the same rows without context ids count as 320 contexts, as the old gate counted them
    flat = [{k: x for k, x in r.items() if k != "context_id"} for r in docs + big]
    assert judge_rows(flat, [], Thresholds()).status == "PASS"


def test_a_graded_uniform_drop_of_004_passes_with_enough_samples():
    # every score falls by 0.04 (0.90 -> 0.86), the margin is 0.05. The bootstrap collapses to a point and the exact
    # sign bound says 1.0 (every sample fell); no score falls by more than graded_flip_delta = 0.1, so no flip. The
    # betting test gains 0.01 per context: by hand its wealth is 11.4 after 300 contexts (< 20) and 28 after 400.
    assert mixture_wealth(300, 0.01) < 20 < mixture_wealth(400, 0.01)
    assert judge_rows(rows([0.9] * 300, [0.86] * 300), [], Thresholds()).status == "INCONCLUSIVE"
    v = judge_rows(rows([0.9] * 400, [0.86] * 400), [], Thresholds())
    assert v.status == "PASS", v.reasons


# --- betting at every look ---


def test_more_losses_never_make_a_pass_easier_nor_more_gains_a_fail():
    # every look is the betting test: its PASS outcomes are a down-set in lost and an up-set in gained (each loss
    # multiplies the wealth by less than each unchanged context, each gain by more), and its FAIL outcomes the reverse
    t = Thresholds(min_samples=1, min_cell_accuracy=None)
    status = [judge_rows(rows([1] * 100, [0] * lost + [1] * (100 - lost)), [], t).status for lost in range(0, 16, 3)]
    order = {"PASS": 0, "INCONCLUSIVE": 1, "FAIL": 2}
    assert [order[x] for x in status] == sorted(order[x] for x in status) and {"PASS", "FAIL"} <= set(status)
    assert judge_rows(rows([1] * 59 + [0], [0] * 6 + [1] * 53 + [1]), [], Thresholds()).status == "INCONCLUSIVE"


# --- graded scores, KL, cells ---


def test_graded_flips_need_a_change_larger_than_the_delta():
    # 100 graded samples; 20 fall by 0.3, the rest are unchanged: 20% "decreased by more than 0.1", over the 10% limit
    base = [0.8] * 100
    v = judge_rows(rows(base, [0.5] * 20 + [0.8] * 80), [], Thresholds())
    text = "\n".join(v.reasons)
    assert "decreased by more than 0.1" in text and "flipped" not in text
    # a change of 0.05 on every sample is no flip at all at delta 0.1, and 100 flips at delta 0.01
    small = rows(base, [0.75] * 100)
    assert "decreased by more than" not in "\n".join(judge_rows(small, [], Thresholds()).reasons)
    assert "100 of 100 samples decreased by more than 0.01" in "\n".join(
        judge_rows(small, [], Thresholds(graded_flip_delta=0.01)).reasons
    )


def test_a_pass_over_documents_is_not_one_over_their_questions_when_the_big_documents_lose():
    """300 one-question documents kept beside one document of 300 questions all lost: over the 301 documents the drop
    is 1/301, a PASS; over the 600 questions it is 0.5, which a deployment asking many questions of that document
    sees. Before: PASS. Control: the big document kept, a PASS; documents of one question each are unaffected."""

    def docs(big_lost: bool) -> list[dict]:
        out = rows([1] * 600, [1] * 300 + [0 if big_lost else 1] * 300)
        for r in out:
            if int(r["sample_id"]) >= 300:
                r["context_id"] = "c-big"  # one document, 300 questions on it
        return out

    v = judge_rows(docs(True), [], Thresholds())
    assert v.status == "INCONCLUSIVE", v.reasons
    assert any(
        "shown within the thresholds over its 301 documents, each weighed once, but over its 600 questions" in r
        and "drop +0.500 over the 0.05 margin and 50% lost, over the 10% flip-rate limit" in r
        for r in v.reasons
    ), v.reasons
    assert v.advice.startswith("the documents' figures hold and their questions' do not")
    assert judge_rows(docs(False), [], Thresholds()).status == "PASS"


def _kl_rows(n: int, kl: float) -> list[dict]:
    return [{**r, "kl_mean": 0.0 if r["variant"] == "baseline" else kl} for r in rows([1] * n, [1] * n)]


def test_mean_kl_is_shown_below_the_limit_not_estimated():
    # a point estimate at the limit passed half the time; now the capped mean must be shown below max_mean_kl (0.1,
    # rows capped at 30 x 0.1 = 3 nats, values divided by the cap: the limit 1/30). Every row at 0.01 gains
    # (0.1 - 0.01) / 3 = 0.03 per context on the bet: by hand the wealth reaches 20 at 125 contexts, not at 124 (the
    # tail check off: it alone asks for more)
    n = next(n for n in range(1, 1000) if mixture_wealth(n, 0.03, margin=1 / 30) >= 20)
    assert n == 125
    capped_only = Thresholds(max_kl_tail_share=None)
    assert judge_rows(_kl_rows(n, 0.01), [], capped_only).status == "PASS"
    assert judge_rows(_kl_rows(n - 1, 0.01), [], capped_only).status == "INCONCLUSIVE"
    # with the tail check (max_kl_tail_share 0.01), no row above the cap gains 0.01 / 0.99 a context on the bet "the
    # share is below 0.01": by hand the wealth reaches 20 at 378 contexts
    tail = next(n for n in range(1, 1000) if mixture_wealth(n, 0.01, margin=0.01) >= 20)
    assert tail == 378
    assert judge_rows(_kl_rows(tail, 0.01), [], Thresholds()).status == "PASS"
    assert judge_rows(_kl_rows(tail - 1, 0.01), [], Thresholds()).status == "INCONCLUSIVE"
    at_limit = judge_rows(_kl_rows(n, 0.1), [], Thresholds())
    assert at_limit.status == "INCONCLUSIVE" and "the capped mean KL may be as large as" in "\n".join(at_limit.reasons)
    over = judge_rows(_kl_rows(60, 0.5), [], Thresholds())
    assert over.status == "FAIL" and "mean KL at least" in "\n".join(over.reasons)


def test_a_constant_graded_cell_gets_no_p_of_zero():
    # every score in the cell is 0.3 (limit 0.5): the old t-test shortcut said p = 0.0. The betting test gains 0.2
    # per context, 0.2 / 0.5 of the stake: by hand its wealth is 14.5 after 10 contexts (p = 1/14.5 = 0.069, not
    # shown) and 840 after 20 (p = 0.0012)
    wealth = lambda n: sum(0.25 * (1 + th * 0.2 / 0.5) ** n for th in THETAS)  # noqa: E731
    ten = judge_rows(rows([0.9] * 10, [0.3] * 10), [], Thresholds()).cells[0]
    assert ten["p"] == pytest.approx(1 / wealth(10), rel=1e-9) and ten["status"] == "no failure shown"
    twenty = judge_rows(rows([0.9] * 20, [0.3] * 20), [], Thresholds()).cells[0]
    assert twenty["p"] == pytest.approx(1 / wealth(20), rel=1e-9) and twenty["status"] == "shown to fail"


def test_a_pass_whose_cells_were_not_judged_says_so():
    # 10 cells of 8 samples; Holm over 10 cells needs 10 all-wrong contexts a cell to reach the wealth 200 by betting
    # (0.25 (2^9 + 1.8^9 + 1.6^9 + 1.4^9) = 199.95 < 200)
    assert sum(0.25 * (1 + th) ** 9 for th in THETAS) < 200 <= sum(0.25 * (1 + th) ** 10 for th in THETAS)
    cells = lambda i: {"depth": i % 10}  # noqa: E731
    v = judge_rows(rows([1] * 80, [1] * 80, cell=cells), [], Thresholds())
    assert v.status == "PASS"
    assert any("no cell judged by min_cell_accuracy=0.5" in x for x in v.not_judged), v.not_judged
    v10 = judge_rows(rows([1] * 100, [1] * 100, cell=cells), [], Thresholds())
    assert v10.status == "PASS" and not any("no cell judged" in x for x in v10.not_judged)


# --- one p-value per variant ---


def test_one_p_value_per_variant_the_largest_of_its_checks_corrected_across_variants():
    # variant a: 0 lost of 120; variant b: 0 lost of 120 but mean KL at 0.09 (just below the 0.1 limit, weakly shown)
    a = [r for r in _kl_rows(120, 0.0)]
    b = [{**r, "variant": "knorm@0.25"} for r in _kl_rows(120, 0.09) if r["variant"] != "baseline"]
    v = judge_rows(a + b, [], Thresholds())
    g = {name: v.variants[name]["gate"] for name in ("snapkv@0.25", "knorm@0.25")}
    for s in g.values():
        assert s["p_pass"] == pytest.approx(max(c["p_holds"] for c in s["checks"].values()))
    assert g["knorm@0.25"]["p_pass"] > g["snapkv@0.25"]["p_pass"]


# --- KL tails above the cap, and the KL's FAIL, through the gate's own judge (benchmarks/stats_coverage.py) ---


def test_a_kl_tail_at_the_share_limit_rarely_passes():
    """1% of rows at 10 nats, the rest at 0: the true mean KL is the limit (0.1), the capped mean 0.03. Before, only a
    run that drew no tail row could PASS, and one did from 112 documents: 0.99^112 = 32%. Now its share of rows above
    the cap sits at max_kl_tail_share (0.01), so a run must show the tail rare. At the first n at which the rest PASS
    (378, by hand in test_mean_kl_is_shown_below_the_limit_not_estimated) and at 1000, judge() gives the largest tail
    count that PASSes; 300 seeded runs each PASS at most 5% plus two Monte Carlo errors (1.26% at 300 draws), and the
    exact binomial chance of that region at most 5%."""
    bench = bench_module()
    judged = bench.Judged(bench.Tail(0.01, 10.0, 0.0))
    assert judged(378, 0) == "PASS" and judged(377, 0) == "INCONCLUSIVE"  # the positive control: no tail, a PASS
    assert 0.99**112 > 0.3  # what the old gate let through
    for n in (378, 1000):
        edge = judged.edge(n, "PASS")
        assert judged(n, edge + 1) != "PASS" and judged(n, edge + 3) != "PASS"
        drawn = np.random.default_rng(n).binomial(n, 0.01, 300)
        assert judged(n, int(drawn.max())) != "PASS" or drawn.max() <= edge
        rate = float(np.mean(drawn <= edge))
        assert rate <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / 300), (n, edge, rate)
        assert binom.cdf(edge, n, 0.01) <= 0.05, (n, edge)


def test_kl_at_twice_the_limit_fails_with_power_at_the_planners_n():
    """6% of rows at 3 nats, the rest at 0.021: a mean KL of 0.2, twice the limit. Before, its FAIL fired 0.25% of
    the time at 59 documents and never from 300 (bold bets "above" lose most of their stake on every small row). At
    the planner's count for a FAIL at twice the limit (python -m evalkit.gate --plan), judge() gives the fewest rows
    at 3 nats that FAIL; of 200 seeded runs at least 75% FAIL (the planner sizes for 80% on the rows most spread
    below the cap; these are less spread), and the exact binomial chance is at least 80%. The control: no KL at all
    PASSes there."""
    bench = bench_module()
    n = kl_fail_contexts(Thresholds())
    assert 600 <= n <= 800, n
    tail = bench.TWICE[0]
    judged = bench.Judged(tail)
    assert tail.mean == pytest.approx(0.2)
    edge = judged.edge(n, "FAIL")
    assert judged(n, edge - 1) != "FAIL" and judged(n, edge + 3) == "FAIL"
    drawn = np.random.default_rng(2).binomial(n, tail.share, 200)
    rate = float(np.mean(drawn >= edge))
    assert rate >= 0.75 and binom.sf(edge - 1, n, tail.share) >= 0.8, (n, edge, rate)
    assert bench.Judged(bench.Tail(0.0, 3.0, 0.0))(n, 0) == "PASS"
