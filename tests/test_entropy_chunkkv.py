"""entropy_chunkkv: ChunkKV gated by each chunk's score entropy (kvpress's EntropyGatedChunkKVPress), by hand on one
small layer, against what plain ChunkKV and a plain top-k keep, and end to end; kvpress's choices on the real model
in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.errors import ConfigError
from evalkit.policies import LayerView
from evalkit.policies.chunkkv import ChunkKV
from evalkit.policies.entropy_chunkkv import EntropyGatedChunkKV, entropy
from tests.conftest import run_cli, tiny_row
from tests.test_criticalkv import FirstChannel

# Chunks of 4: c0 = 1 1 1 1 (mean 1, entropy 1), c1 = 8 .2 .1 0 (mean 2.075, entropy low), c2 = .5 .6 .7 .4 (mean
# .55, entropy just below 1). Medians: mean 1, entropy c2's. Important (mean >= 1): c0, c1; spiky (entropy below the
# median): c1 only.
SCORES = [1, 1, 1, 1, 8, 0.2, 0.1, 0, 0.5, 0.6, 0.7, 0.4]


def layer() -> LayerView:
    keys = torch.tensor(SCORES).view(1, 1, 12, 1)
    return LayerView(0, 1, 12, keys, keys.clone(), torch.arange(12).view(1, 1, 12), {}, {})


def test_the_entropy_of_a_chunk_by_hand():
    p = torch.tensor([8, 0.2, 0.1, 0]) / 8.3
    want = -sum(float(x) * math.log(float(x)) for x in p if x > 0) / math.log(4)
    torch.testing.assert_close(entropy(torch.tensor([8, 0.2, 0.1, 0])), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert float(entropy(torch.ones(4))) == pytest.approx(1.0)
    assert float(entropy(torch.tensor([3.0]))) == 0.0  # one token: no spread
    # a negative score shifts the chunk up by its minimum: -1 0 1 is 0 1 2
    torch.testing.assert_close(entropy(torch.tensor([-1.0, 0, 1])), entropy(torch.tensor([0.0, 1, 2])))


def test_a_spiky_important_chunk_keeps_its_best_tokens_and_the_budget_goes_on_by_hand():
    """Keeping 6: c1 first (best mean) but spiky: its best 2 (4, 5); then c0 whole (0-3). Plain ChunkKV keeps c1
    whole and 2 of c0; a plain top-6 takes 4, 0-3 and 10. Keeping 11: c1 2, c0 4, c2 4, then the one token left goes
    to the best token not kept, 6 (0.1)."""
    pol = EntropyGatedChunkKV(inner=FirstChannel(), budget=6, chunk_size=4, low_entropy_chunk=2)
    assert pol.select(layer(), 6).tolist() == [[[0, 1, 2, 3, 4, 5]]]
    assert ChunkKV(inner=FirstChannel(), budget=6, chunk_size=4).select(layer(), 6).tolist() == [[[0, 1, 4, 5, 6, 7]]]
    assert FirstChannel().select(layer(), 6).tolist() == [[[0, 1, 2, 3, 4, 10]]]
    assert pol.select(layer(), 11).tolist() == [[[0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]]]


def test_settings_it_cannot_use_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="^chunk_size=4, low_entropy_chunk=4"):
        EntropyGatedChunkKV(inner=FirstChannel(), chunk_size=4, low_entropy_chunk=4).validate(None)
    result = run_cli("model=tiny-random", "policy=entropy_chunkkv", "policy.decode=true", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "compresses once, after the prompt: set policy.decode=false" in result.stderr


def test_the_command_line_runs_it_over_snapkv(tmp_path):
    row = tiny_row(tmp_path, "variants=[entropy_chunkkv/snapkv@0.5]")
    assert row["variant"] == "entropy_chunkkv(snapkv)@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
