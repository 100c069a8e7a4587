"""qfilter (Q-Filters, kvpress's QFilterPress) by hand; its calibration (`python -m evalkit.calibrate qfilter`)
against the eigenvectors worked out by hand, and end to end on the tiny model from a file calibrated here; one-line
refusals of a missing or foreign file. kvpress's choices with the same SmolLM2 file in tests/test_peer_kvpress.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from evalkit.calibrate.qfilter import filters
from evalkit.policies import LayerView
from evalkit.policies.qfilter import QFilter
from tests.conftest import COMMAND_ENV, ROOT, run_cli, tiny_row


def test_a_key_far_along_the_filter_ranks_last_by_hand():
    """Filter (1, 0): scores -<f, k> = -2, 1, 0, -0.5 for keys (2,0) (-1,0) (0,5) (0.5,0): keeping 2 takes 1 and 2."""
    pol = QFilter(budget=2, weights_path="unused")
    pol.filters = torch.tensor([[[1.0, 0.0]]])  # (layers, KV heads, D)
    keys = torch.tensor([[2.0, 0], [-1, 0], [0, 5], [0.5, 0]]).view(1, 1, 4, 2)
    view = LayerView(0, 1, 4, keys, keys, torch.arange(4).view(1, 1, 4), {}, {})
    assert pol.score(view)[0, 0].tolist() == [-2.0, 1.0, -0.0, -0.5]
    assert pol.select(view, 2).tolist() == [[[1, 2]]]


def test_calibrated_filters_are_the_groups_top_singular_direction_signed_against_the_queries_by_hand():
    """One layer, two query heads of one KV head, queries (3, 1) (3, -1) and (2, 0): Q^T Q = diag(22, 2), top
    direction +-(1, 0); the queries' summed projection on (1, 0) is 8 > 0, so the filter is (-1, 0)."""
    q = [torch.tensor([[3.0, 1], [3, -1]], dtype=torch.float64), torch.tensor([[2.0, 0]], dtype=torch.float64)]
    total = torch.stack([x.sum(0) for x in q])  # (Hq, D)
    gram = torch.stack([x.T @ x for x in q])  # (Hq, D, D)
    f = filters({0: (total, gram)}, n_kv=1)
    assert f.shape == (1, 1, 2)
    torch.testing.assert_close(f[0, 0], torch.tensor([-1.0, 0.0]))


def test_filters_calibrated_here_run_from_the_command_line_and_are_recorded(tmp_path):
    out = tmp_path / "qf"
    cmd = [sys.executable, "-m", "evalkit.calibrate", "qfilter", "--model", "tiny-random", "--out", str(out)]
    cmd += ["--lengths", "128", "--depths", "0.5"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, **COMMAND_ENV})
    assert json.loads((out / "config.json").read_text()) == {"num_layers": 3, "num_kv_heads": 2, "kv_head_dim": 16}
    row = tiny_row(tmp_path / "run", "policy=qfilter", "policy.budget=0.5", f"policy.weights_path={out}")
    assert row["variant"] == "qfilter@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
    prepared = json.loads((tmp_path / "run" / "run.json").read_text())["prepared"]["qfilter@0.5"]
    assert prepared["weights_path"] == str((out / "model.safetensors").resolve()) and len(prepared["sha256"]) == 64


def test_missing_or_foreign_filters_are_refused_in_one_line(tmp_path):
    foreign = tmp_path / "smollm2"  # SmolLM2's shape (30 layers x 3 KV heads x 64), given to the tiny model
    foreign.mkdir()
    save_file({"q_filters": torch.zeros(30, 3, 64)}, str(foreign / "model.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for args, message in [
        (["policy=qfilter"], "qfilter needs its filters: give policy.weights_path=DIR"),
        (["policy=qfilter", f"policy.weights_path={tmp_path / 'none'}"], "no such file"),
        (["policy=qfilter", f"policy.weights_path={tmp_path / 'junk.safetensors'}"], "not a Q-Filters file"),
        (["policy=qfilter", f"policy.weights_path={foreign}"], "filters of shape (30, 3, 64), the model needs"),
    ]:
        result = run_cli("model=tiny-random", *args, "task.context_lengths=[128]", f"hydra.run.dir={tmp_path / 'r'}")
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert message in result.stderr, result.stderr
    with pytest.raises(ValueError, match=r"prepare\(\) was not called"):
        QFilter(budget=1, weights_path="x").score(LayerView(0, 1, 2, *[torch.ones(1, 1, 2, 2)] * 2, None))
