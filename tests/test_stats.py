"""The gate's statistics against published worked examples and by simulation: Tango's interval
for paired 0/1 data, the exact bound with no loss, the BCa bootstrap against scipy's where it holds, Holm's
correction, and the three outcomes on built records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import bootstrap

from evalkit.cli.gate import main
from evalkit.errors import ConfigError
from evalkit.gate.decide import min_samples
from evalkit.stats import BCa, adjust, binary_bounds, paired_drop, tango_z
from evalkit.thresholds import Thresholds, thresholds
from tests.conftest import drew, judge_rows
from tests.test_gate import rows, run_info
from tests.test_stats_coverage import bench_module


def test_tango_interval_matches_the_published_example():
    # Cavo et al. 2012 (complete response before/after consolidation), Fagerland, Lydersen & Laake, "Statistical
    # Analysis of Contingency Tables" (2017) ch. 8: n12 = 6, n21 = 16, N = 161; Tango's 95% CI -0.1240 to -0.0054
    lo, hi = binary_bounds(6, 16, 161, level=0.975)  # a two-sided 95% interval is two one-sided 97.5% bounds
    assert (round(lo, 4), round(hi, 4)) == (-0.1240, -0.0054)


@pytest.mark.parametrize(("b", "c", "n", "delta"), [(6, 16, 161, 0.03), (3, 1, 20, -0.1), (0, 5, 40, 0.05)])
def test_tango_constrained_estimate_is_the_likelihood_maximum(b, c, n, delta):
    """The closed form of Tango's restricted estimate against the multinomial likelihood maximised numerically."""
    lo, hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12

    def nll(p21):
        p12 = p21 + delta
        return -(b * math.log(p12) + c * math.log(p21) + (n - b - c) * math.log(1 - p12 - p21))

    p21 = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12}).x
    z = (b - c - n * delta) / math.sqrt(n * (2 * p21 + delta * (1 - delta)))
    assert tango_z(b, c, n, delta) == pytest.approx(z, rel=1e-5)


def test_no_loss_is_bounded_exactly():
    # 0 lost of n: the exact one-sided 95% bound on the loss rate is 1 - 0.05 ** (1 / n) (Clopper-Pearson)
    assert binary_bounds(0, 0, 20)[1] == pytest.approx(1 - 0.05 ** (1 / 20)) == pytest.approx(0.1391, abs=1e-4)
    assert binary_bounds(0, 0, 58)[1] > 0.05 > binary_bounds(0, 0, 59)[1]
    # the gate judges every look by betting: its lossless floor is the betting count, derived by hand below
    assert min_samples(Thresholds()) == lossless_betting_count() == 74


def test_bca_matches_scipy_where_it_holds_and_betting_bounds_the_rest():
    # BCa only from 100 samples with 30 that differ (the review: at 20 samples with 69% ties its upper bound falls
    # below the true drop 26.6% of the time); the rest gets the bounded-mean bound of evalkit.stats.betting
    rng = np.random.default_rng(3)
    base = rng.random(120)
    pol = np.clip(base - rng.normal(0.02, 0.08, 120), 0, 1)
    p = paired_drop(list(base), list(pol), level=0.95)
    ref = bootstrap((base - pol,), np.mean, method="BCa", confidence_level=0.90, n_resamples=9999, random_state=0)
    assert p.method == "bca-bootstrap"
    assert p.lower == pytest.approx(ref.confidence_interval.low, abs=3e-3)
    assert p.upper == pytest.approx(ref.confidence_interval.high, abs=3e-3)
    bca = BCa.of(base - pol)
    assert bca.p_below(p.upper) == pytest.approx(0.05, abs=2e-3)  # the p-value inverts the bound
    assert paired_drop(list(base[:60]), list(pol[:60])).method == "betting"  # 60 samples: BCa does not hold yet
    flat = paired_drop([0.5] * 30, [0.5] * 30)  # every difference 0: the percentile bootstrap said [0, 0]
    assert flat.method == "betting" and 0 < flat.upper < 0.2
    # 29 identical pairs and one gain of 0.5: BCa said [-0.067, +0.000] (a PASS); the betting bound does not
    assert paired_drop([0.5] * 30, [0.5] * 29 + [1.0]).upper > 0.05
    uniform = paired_drop([0.9] * 400, [0.86] * 400)  # every difference 0.04: the bootstrap collapses to a point
    assert uniform.method == "betting" and 0.04 < uniform.upper < 0.05


@pytest.mark.parametrize("n", [10, 20, 59, 200])
@pytest.mark.parametrize(("p_lost", "p_gained"), [(0.0, 0.0), (0.05, 0.0), (0.05, 0.02), (0.10, 0.05), (0.3, 0.1)])
def test_bounds_cover_the_true_drop(n, p_lost, p_gained):
    up, lo, both = bench_module().coverage(p_lost, p_gained, n, draws=2000)
    assert min(up, lo, both) >= 0.94, (up, lo, both)


def test_holm_and_bonferroni_on_the_textbook_example():
    # Holm (1979) as usually taught: p = 0.01, 0.04, 0.03, 0.005 at alpha 0.05. Sorted, 0.005 < 0.05/4 and
    # 0.01 < 0.05/3 are rejected, 0.03 > 0.05/2 stops.
    p = [0.01, 0.04, 0.03, 0.005]
    assert adjust(p, 0.05, "holm") == [True, False, False, True]
    assert adjust(p, 0.05, "bonferroni") == [True, False, False, True]
    assert adjust(p, 0.05, "none") == [True, True, True, True]
    # where they differ: 0.01 < 0.05/3, then 0.02 < 0.05/2, then 0.04 < 0.05 (Holm); Bonferroni holds all to 0.05/3
    assert adjust([0.01, 0.02, 0.04], 0.05, "holm") == [True, True, True]
    assert adjust([0.01, 0.02, 0.04], 0.05, "bonferroni") == [True, False, False]
    assert adjust([0.01, math.nan], 0.05, "holm") == [True, False]  # NaN: not judged, not in the family


def test_holm_decides_as_closed_testing_and_statsmodels_on_random_families():
    """evalkit's Holm (written out: statsmodels' runs a garbage collection per call) against its definition, closed
    testing with Bonferroni's local test (H_i is rejected when every intersection of hypotheses holding i is: the
    smallest p-value of each subset S at most alpha / |S|), on 400 families of 1 to 8 p-values with ties and values
    on the thresholds; and against statsmodels' own on 10 of them."""
    import itertools

    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(0)
    for trial in range(400):
        m = int(rng.integers(1, 9))
        p = rng.choice([*rng.uniform(0, 0.2, 6), 0.05 / 3, 0.025, 0.0125, 0.05, 1.0], size=m).tolist()
        alpha = float(rng.choice([0.01, 0.05, 0.1]))
        subsets = [s for k in range(1, m + 1) for s in itertools.combinations(range(m), k)]
        closed = [all(min(p[j] for j in s) <= alpha / len(s) for s in subsets if i in s) for i in range(m)]
        assert adjust(p, alpha, "holm") == closed, (p, alpha)
        if trial < 10:
            assert closed == multipletests(p, alpha=alpha, method="holm")[0].tolist(), (p, alpha)


def _task_run(samples_per_cell: int) -> list[dict]:
    return [{"config": {"task": {"name": "middoc", "samples_per_cell": samples_per_cell}}}]


def lossless_betting_count(alpha: float = 0.05, margin: float = 0.05) -> int:
    """By hand from evalkit.stats.betting's construction: with nothing lost the mixture's wealth after n contexts is
    sum_j w_j (1 + theta_j margin / (1 - margin))^n, over the bets theta = 1, 0.8, 0.6, 0.4 weighted 1/4 each; the
    anytime-valid test PASSes once it reaches 1 / alpha."""
    n = 1
    while sum(0.25 * (1 + th * margin / (1 - margin)) ** n for th in (1, 0.8, 0.6, 0.4)) < 1 / alpha:
        n += 1
    return n


def lossless_bound(n: int, alpha: float = 0.05) -> float:
    """By hand: the betting upper bound on the drop after n contexts with nothing lost, the smallest margin m whose
    mixture wealth sum_j w_j (1 + theta_j m / (1 - m))^n reaches 1 / alpha (a bisection)."""
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(60):
        m = (lo + hi) / 2
        wealth = sum(0.25 * (1 + th * m / (1 - m)) ** n for th in (1, 0.8, 0.6, 0.4))
        lo, hi = (lo, m) if wealth >= 1 / alpha else (m, hi)
    return hi


def test_zero_lost_of_20_is_inconclusive_with_the_samples_that_settle_it():
    cells = lambda i: {"position": i % 10}  # noqa: E731  ten cells of two samples, as middoc with samples_per_cell=2
    v = judge_rows(rows([1] * 20, [1] * 20, cell=cells), _task_run(2), Thresholds())
    assert v.status == "INCONCLUSIVE"
    assert f"the drop may be as large as {lossless_bound(20):.3f}" in "\n".join(v.reasons)
    # every look is the anytime-valid test, which needs 74 lossless samples; the reasons state the cost against a
    # test judged once at a fixed count, 59 (0.95^59 < 0.05 < 0.95^58)
    assert lossless_betting_count() == 74 and 0.95**59 < 0.05 < 0.95**58
    assert (
        "20 samples, fewer than gate.min_samples=74 (a lossless PASS needs 74 by betting, which holds at every look; "
        "a test judged once would need 59)"
    ) in v.reasons[-1]
    assert v.advice == (
        "at the observed rates, 74 samples would show it with about 80% chance at look 2 (judged by the anytime-valid "
        "betting test): add at least 54, e.g. task.samples_per_cell=8 resume=true"
    )
    # every cell has 2 samples: none can be shown failing (with Holm over 10 cells, by betting)
    need = all_wrong_cell_count(0.005)
    assert {c["status"] for c in v.cells} == {f"not judged: 2 samples, a failure here can be shown from {need}"}


def test_zero_lost_of_74_passes_and_a_clear_regression_fails():
    n = lossless_betting_count()
    assert judge_rows(rows([1] * n, [1] * n), [], Thresholds()).status == "PASS"
    assert judge_rows(rows([1] * (n - 1), [1] * (n - 1)), [], Thresholds()).status == "INCONCLUSIVE"
    worse = judge_rows(rows([1] * 40, [0] * 12 + [1] * 28), [], Thresholds())  # 12 of 40 lost
    assert worse.status == "FAIL"
    assert "shown over the 0.05 margin" in "\n".join(worse.reasons)


def cell_wealth(right: int, wrong: int, limit: float = 0.5) -> float:
    """By hand from evalkit.stats.betting's construction: the mixture wealth of the bet "accuracy below limit".

    On a cell of 0/1 scores a wrong answer gains theta limit / (1 - limit), a right one loses theta (1 - limit) /
    (1 - limit)."""
    return sum(0.25 * (1 + th * limit / (1 - limit)) ** wrong * (1 - th) ** right for th in (1, 0.8, 0.6, 0.4))


def all_wrong_cell_count(budget: float, limit: float = 0.5) -> int:
    """The contexts before an all-wrong cell's wealth reaches 1 / budget."""
    n = 1
    while cell_wealth(0, n, limit) < 1 / budget:
        n += 1
    return n


def test_holm_changes_a_borderline_cell_fail():
    # ten cells of 12 samples, the baseline right everywhere, judged by betting at every look. Cell 0: the policy gets
    # 0 of 12 right (p = 1 / 1397 = 0.0007); cell 1: 1 of 12 (p = 1 / 55.8 = 0.018). Uncorrected both are below
    # 0.05; Holm over 10 cells rejects 0.0007 < 0.005, then compares 0.018 with 0.05/9 and stops.
    assert 1 / cell_wealth(0, 12) < 0.005 and 0.05 / 9 < 1 / cell_wealth(1, 11) < 0.05

    def policy_score(i):
        cell, k = divmod(i, 12)
        return 0 if (cell == 0 or (cell == 1 and k > 0)) else 1

    records = rows([1] * 120, [policy_score(i) for i in range(120)], cell=lambda i: {"cell": i // 12})
    status = {
        m: {c["cell"]: c["status"] for c in judge_rows(records, [], Thresholds(multiplicity=m)).cells}
        for m in ("holm", "none")
    }
    assert status["holm"]["cell=0"] == "shown to fail" and status["holm"]["cell=1"] == "no failure shown"
    assert status["none"]["cell=0"] == status["none"]["cell=1"] == "shown to fail"
    assert all_wrong_cell_count(0.005) == 10  # wealth 199.95 < 200 after 9 all-wrong contexts, 380 after 10


def test_several_variants_are_corrected_together():
    # 0 lost of 74 reaches the wealth 20 (p <= 0.05), not 40 (Holm's first step over 2 variants, 0.025): alone it
    # PASSes, with a second variant it is no longer shown
    n = lossless_betting_count()
    assert lossless_betting_count(0.025) > n
    one = rows([1] * n, [1] * n)
    two = one + [r for r in rows([1] * n, [1] * n, variant="knorm@0.25") if r["variant"] != "baseline"]
    assert judge_rows(one, [], Thresholds()).status == "PASS"
    v = judge_rows(two, [], Thresholds())
    assert v.status == "INCONCLUSIVE" and "Holm's correction over 2 variants" in "\n".join(v.reasons)
    assert judge_rows(two, [], Thresholds(multiplicity="none")).status == "PASS"


def test_plan_prints_the_samples_a_pass_needs(capsys, tmp_path):
    assert main(["--plan", "--cells", "10", "--loss", "0"]) == 0
    out = capsys.readouterr().out
    assert f"loss rate  0.0%, gain rate  0.0%: {lossless_betting_count()} / 74 samples (8 / 8 per cell)" in out
    # the cost of judging at every look, against a test judged once: (1 - 0.05)^59 < 0.05 < 0.95^58
    assert 0.95**59 < 0.05 < 0.95**58
    assert "With nothing lost a PASS needs 74 contexts, where a test judged once" in out and "would need 59" in out
    assert f"per cell: {all_wrong_cell_count(0.005)} contexts before a cell" in out
    assert "gate.min_samples: 74" in out
    assert main(["--plan", "--variants", "0"]) == 2
    assert main(["--plan", "--loss", "0.6", "--gain", "0.6"]) == 2
    assert main(["--plan", "--icc", "2"]) == 2
    assert main([]) == 2


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"confidence": 1.5}, "gate.confidence=1.5"),
        ({"multiplicity": "fdr"}, "gate.multiplicity='fdr'"),
        ({"max_drop": -0.1}, "gate.max_drop=-0.1"),
        ({"min_samples": 0}, "gate.min_samples=0"),
        ({"graded_flip_delta": 1.0}, "gate.graded_flip_delta=1.0"),
        ({"graded_flip_delta": "x"}, "gate.graded_flip_delta='x'"),
    ],
)
def test_bad_thresholds_are_one_line_errors(cfg, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        thresholds(cfg, "'test'")


def test_verdict_lists_every_cell(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    cells = lambda i: {"position": i % 3}  # noqa: E731
    written = rows([1] * 30, [1] * 30, cell=cells)
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
    (folder / "run.json").write_text(json.dumps(drew(run_info("r1"), written)))
    assert main([str(folder)]) == 2
    doc = json.loads((folder / "verdict.json").read_text())
    assert doc["verdict"] == "INCONCLUSIVE" and len(doc["cells"]) == 3
    assert all({"n", "lost", "gained", "bounds", "status"} <= set(c) for c in doc["cells"])
    report = (folder / "report.md").read_text()
    assert "| snapkv@0.25 | position=0 | 10 | 1.00 | 1.00 | 0 | 0 |" in report
