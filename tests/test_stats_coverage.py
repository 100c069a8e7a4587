"""The proof, reduced to a CI grid: benchmarks/stats_coverage.py's simulation of the gate's error rate at the margin
(one look, the README's 20 -> 60 -> 130 sequence, the gate's own advice) and of its power at the planner's n; and
the simulation's vectorised decision checked against the gate's own, draw by draw."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from evalkit.gate.decide import variant_decisions
from evalkit.gate.power import draw_contexts
from evalkit.thresholds import Thresholds
from tests.conftest import as_rows

ROOT = Path(__file__).resolve().parents[1]


def bench_module():
    """benchmarks/stats_coverage.py, imported as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("stats_coverage", ROOT / "benchmarks" / "stats_coverage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_reduced_grid_keeps_every_error_rate_and_the_planned_power(capsys):
    # m = 10 at icc 0.5, m = 5 at icc 0.3, graded scores, one look and both extend-and-judge sequences: each PASS
    # rate at the margin is at most 5% (plus two Monte Carlo errors), and at the planner's n for 80% power at a 1%
    # loss rate (205: every look is the betting test) at least 80% (less two errors) of the runs PASS; and the routes
    # that once restarted an exact first look (looks deleted, +10 at a time, the advice) hold the 5% as well
    assert bench_module().main(["--quick", "--draws", "1000"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "0 rows out of bounds" in out and "looks 205 (one look)" in out and "then +10 15 times" in out


def _rows(lost: np.ndarray, gained: np.ndarray, m: int, step: float) -> list[dict]:
    """Per-question rows of contexts with these lost and gained counts (a loss moves a score by `step`)."""
    out = []
    for k, (nl, ng) in enumerate(zip(lost, gained, strict=True)):
        for q in range(m):
            base, pol = (1.0, 1.0 - step) if q < nl else (1.0 - step, 1.0) if q < nl + ng else (1.0, 1.0)
            common = {"sample_id": f"{k}-{q}", "context_id": f"ctx{k}", "cell": {"depth": 0.5}, "baseline_score": base}
            out.append({**common, "variant": "snapkv@0.25", "score": pol})
    return out


@pytest.mark.parametrize(
    ("m", "icc", "loss", "step", "k"),
    [(5, 0.3, 0.015, 1.0, 90), (1, 0.0, 0.02, 1.0, 205), (3, 0.5, 0.4, 0.1, 400)],
    ids=["m5", "m1", "graded"],
)
def test_the_simulation_judges_as_the_gate_does(m, icc, loss, step, k):
    bench = bench_module()
    s = bench.Scenario(loss, 0.0, m, icc, step)
    rng = np.random.default_rng(11)
    lost, gained = draw_contexts(rng, 8, k, m, loss, 0.0, icc)
    runs = bench.Runs(s, step * (lost - gained) / m, lost / m if step > 0.1 else np.zeros(lost.shape))
    simulated = runs.passes(np.full(8, k))
    gate = [
        variant_decisions({"snapkv@0.25": as_rows(_rows(lost[i], gained[i], m, step))}, Thresholds())[
            "snapkv@0.25"
        ].status
        == "PASS"
        for i in range(8)
    ]
    assert list(simulated) == gate
    assert 0 < sum(gate) < 8  # both outcomes seen: the comparison means something


@pytest.mark.parametrize("protocol", ["query_agnostic", "query_aware"])
def test_the_document_section_judges_as_the_gate_does(protocol):
    # the rows the documents section judges, given the fields the gate's decision reads, decided by the gate: the
    # same PASS draw by draw under either protocol (under query_aware every question has its own context)
    bench = bench_module()
    lost, gained = draw_contexts(np.random.default_rng(5), 8, 90, 5, 0.015, 0.0, 0.3)
    out = []
    for i in range(8):
        rows = bench.document_rows(lost[i], gained[i], 5, protocol)
        assert len({r["document_id"] for r in rows}) == 90
        assert len({r["context_id"] for r in rows}) == (450 if protocol == "query_aware" else 90)
        full = [r.replace(sample_id=str(j), variant="snapkv@0.25") for j, r in enumerate(rows)]
        decided = variant_decisions({"snapkv@0.25": full}, Thresholds())["snapkv@0.25"].status == "PASS"
        assert bench.judged(rows, Thresholds())[0] == decided
        out.append(decided)
    assert 0 < sum(out) < 8  # both outcomes seen: the comparison means something
