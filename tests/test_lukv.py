"""lukv (LU-KV, kvpress's LUKVPress): the heads' counts from a curve by hand, the choice on a hand-built layer, the
curve's row for a budget, end to end from a curve computed here (`python -m evalkit.calibrate lukv`), and one-line
refusals; kvpress's choices with the same SmolLM2 curve in tests/test_peer_kvpress.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from evalkit.policies import LayerView
from evalkit.policies.lukv import LUKV, head_counts
from tests.conftest import WEIGHTS_TINY, run_cli, tiny_row
from tests.test_criticalkv import FirstChannel


def test_head_counts_round_the_layers_total_and_share_the_remainder_by_hand():
    """Keep rates .55 .26 .33 of 10 tokens: ideal 5.5 2.6 3.3, total round(11.4) = 11; floors 5 2 3 and the one left
    to the largest fraction (.6, head 1): 5 3 3. A head's share is at least 1."""
    assert head_counts(torch.tensor([0.55, 0.26, 0.33]), 10).tolist() == [5, 3, 3]
    assert head_counts(torch.tensor([0.5, 0.0, 0.0]), 10).tolist() == [5, 1, 1]


def test_the_curves_row_is_the_prune_ratio_rounded_up():
    """Never a row that keeps more than the budget: 0.336 kept is 66.4% pruned, row 67% (index 66)."""
    assert [LUKV(inner=FirstChannel(), budget=b).row(1000) for b in (0.5, 0.25, 0.336)] == [49, 74, 66]
    assert LUKV(inner=FirstChannel(), budget=250).row(1000) == 74


def test_each_head_keeps_its_curve_share_by_its_scores_with_both_ends_first(tmp_path):
    """One layer, 2 KV heads of 10 tokens at half: the curve prunes 30% of head 0 and 70% of head 1, so they keep 7
    and 3. Scores by the first key channel; sink 1 and window 1 kept first (tokens 0 and 9)."""
    curve = np.zeros((99, 1, 2), dtype=np.float32)
    curve[49] = [[0.3, 0.7]]
    np.save(tmp_path / "c.npy", curve)
    pol = LUKV(inner=FirstChannel(), budget=0.5, sink=1, window=1, weights_path=str(tmp_path / "c.npy"))
    pol.curve = torch.as_tensor(curve)
    keys = torch.tensor([[0.0, 9, 8, 1, 7, 2, 6, 3, 5, 0], [0, 1, 2, 3, 4, 5, 6, 7, 9, 0]]).view(1, 2, 10, 1)
    view = LayerView(0, 1, 10, keys, keys, torch.arange(10).expand(1, 2, 10), {}, {})
    assert pol.over(view, 5)
    assert pol.select(view, 5).tolist() == [[[0, 1, 2, 4, 6, 8, 9], [0, 8, 9, -1, -1, -1, -1]]]
    assert pol.keep_per_layer(10, 1) == [5]  # (7 + 3) / 2 heads


def test_a_curve_computed_here_runs_from_the_command_line(tmp_path):
    row = tiny_row(tmp_path, "policy=lukv", "policy.budget=0.5", f"policy.weights_path={WEIGHTS_TINY['lukv']}")
    assert row["variant"] == "lukv(expected_attention)@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
    prepared = json.loads((tmp_path / "run.json").read_text())["prepared"]["lukv(expected_attention)@0.5"]
    assert prepared["weights_path"].endswith("lukv_tiny.npy") and len(prepared["sha256"]) == 64


@pytest.mark.parametrize(
    ("curve", "message"),
    [
        (None, "lukv needs its budget curve: give policy.weights_path=FILE"),
        ("smollm2", "a curve of shape (99, 30, 3), the model needs (99 prune ratios, layers, KV heads) = (99, 3, 2)"),
        ("keeps_all", "its row for a prune ratio of 99% keeps 1.000 of the tokens on average, more than 0.01"),
    ],
)
def test_missing_foreign_or_overspending_curves_are_refused_in_one_line(tmp_path, curve, message):
    files = {"smollm2": "tests/data/lukv_smollm2.npy", "keeps_all": str(tmp_path / "all.npy")}
    np.save(tmp_path / "all.npy", np.zeros((99, 3, 2), dtype=np.float32))
    given = [f"policy.weights_path={files[curve]}"] if curve else []
    result = run_cli("model=tiny-random", "policy=lukv", *given, f"hydra.run.dir={tmp_path / 'r'}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr, result.stderr
