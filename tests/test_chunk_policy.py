"""chunk: each chunk of the prompt compressed on its own by the inner scorer, keeping its share of the budget
(kvpress's ChunkPress), by hand, its refusals, and end to end; kvpress's choices in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math

import pytest

from evalkit.errors import ConfigError
from evalkit.policies.chunk import Chunk, shares
from evalkit.policies.h2o import H2O
from evalkit.policies.knorm import KNorm
from tests.conftest import tiny_row
from tests.test_block import Outlier, one_head


def test_shares_follow_the_lengths_and_add_up_to_the_budget_by_hand():
    assert shares(413, [256, 256, 256, 58]) == [128, 128, 128, 29]  # 413 x 256 / 826 = 128 exactly
    # 206 x 256 / 826 = 63.85 three times and 14.46: floors 63 63 63 14 (203), the 3 left to the largest remainders
    assert shares(206, [256, 256, 256, 58]) == [64, 64, 64, 14]
    assert shares(3, [2, 2, 2]) == [1, 1, 1] and shares(2, [2, 2, 2]) == [1, 1, 0]  # ties: the first chunks


def test_each_chunk_keeps_its_own_best_by_hand():
    """Keys 0 10 1 | 2 9 3, keep 4, chunks of 3: 2 each. First chunk (mean 3.67): distances 3.67 6.33 2.67 keep 0 1;
    second (mean 4.67): 2.67 4.33 1.67 keep 3 4. The whole prompt (mean 4.17: 4.17 5.83 3.17 2.17 4.83 1.17) would
    keep 0 1 4 and 2; the lowest norm per chunk keeps 0 2 | 3 5, and alone 0 2 3 5 as well."""
    view = one_head([0, 10, 1, 2, 9, 3])
    assert Chunk(inner=Outlier(), budget=4, chunk=3).select(view, 4).tolist() == [[[0, 1, 3, 4]]]
    assert Outlier(budget=4).select(view, 4).tolist() == [[[0, 1, 2, 4]]]
    assert Chunk(inner=KNorm(), budget=4, chunk=3).select(view, 4).tolist() == [[[0, 2, 3, 5]]]


def test_a_scorer_that_needs_attention_observed_is_refused():
    with pytest.raises(ConfigError, match="h2o needs attention observed over the whole prompt, not per chunk"):
        Chunk(inner=H2O(decode=False), budget=0.25).validate(256)
    with pytest.raises(ConfigError, match="^chunk=0"):
        Chunk(inner=KNorm(), budget=0.25, chunk=0).validate(256)


def test_the_command_line_runs_chunk_over_keydiff(tmp_path):
    row = tiny_row(tmp_path, "policy=chunk", "policy.chunk=32", "policy.budget=0.5")
    assert row["variant"] == "chunk(keydiff)@0.5"
    assert row["tokens_held_per_layer"] == [math.ceil(0.5 * row["context_tokens"])] * 3
