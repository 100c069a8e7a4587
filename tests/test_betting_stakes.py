"""benchmarks/betting_stakes.py: its Kelly stake is the log-optimal one, its plug-in stakes are predictable, and on
one path of no losses its wealth is the product it should be."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import betting_stakes as bs  # noqa: E402


@pytest.mark.parametrize(
    ("values", "weights", "target"),
    [
        ((-1.0, 0.0, 1.0), (10.0, 80.0, 3.0), 0.05),
        ((-1.0, 0.0, 1.0), (1.0, 30.0, 4.0), 0.05),
        ((0.0, 1.0), (40, 3), 0.1),
    ],
)
def test_kelly_fraction_maximises_the_log_growth(values, weights, target):
    cap = 0.9 / (max(values) - target)
    got = float(bs.kelly_fraction(values, np.array([weights], dtype=float), target, cap)[0])

    def loss(lam):
        return -sum(w * math.log(1 + lam * (target - v)) for w, v in zip(weights, values, strict=True))

    best = minimize_scalar(loss, bounds=(0.0, cap), method="bounded", options={"xatol": 1e-10}).x
    assert got == pytest.approx(best, abs=1e-5)


def test_kelly_fraction_ends():
    w = np.array([[0.0, 100.0, 0.0], [0.0, 5.0, 5.0]])
    assert bs.kelly_fraction((-1.0, 0.0, 1.0), w, 0.05, 0.5).tolist() == [0.5, 0.0]


@pytest.mark.parametrize("check", [bs.DROP, bs.FLIP])
def test_plugin_stakes_use_only_the_past(check):
    """The stake of step t is the same whatever x_t is: the counts it reads are updated after the step."""
    test = bs.candidates()[-1]
    counts = np.array([[0.0] * (len(check[3]) - 2) + [50.0, 1.0]] * len(check[3]))
    logs = test.start(len(check[3]), check)
    x = np.asarray(check[3], dtype=float)  # each row sees a different value now
    lam = test.stakes(counts, check)
    assert np.allclose(lam, lam[0])
    got = test.step(logs, counts, x, check)
    assert np.allclose(got, np.log1p(lam * (check[0] - x)[:, None]))


def test_lossless_wealth_is_the_product_of_its_stakes():
    """With no loss the plug-in's drop wealth after n contexts is prod (1 + lam_t 0.05), lam_t from its own rule."""
    test = bs.Plugin("k", [("kelly", 200.0, 0.005, 0.9)])
    share, ever, hit = bs.simulate([test], 0.0, 0.0, 3, 80, 0)
    lam = [
        bs.kelly_fraction(bs.DROP[3], np.array([[0.0, 200 * 0.995 + t, 1.0]]), 0.05, 0.9 / 0.95)[0] for t in range(80)
    ]
    wealth = np.cumsum(np.log1p(np.array(lam) * 0.05))
    first = int(np.nonzero(wealth >= bs.NEED)[0][0]) + 1
    assert bs.first_at(share[0])[0] == first
    assert bool(ever[0].all()) and bool(hit[0][0].all())
