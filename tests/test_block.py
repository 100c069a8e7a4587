"""block: the prompt compressed block by block, the inner scorer choosing among the survivors and each next block
(KeyDiff's block processing, as kvpress's BlockPress simulates it), by hand, its refusals, and end to end; kvpress's
choices on the real model in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.block import Block
from evalkit.policies.knorm import KNorm
from evalkit.policies.snapkv import SnapKV
from tests.conftest import tiny_row


@dataclass(kw_only=True)
class Outlier(KVPolicy):
    """A scorer whose choice depends on the set it is shown: distance of a 1-D key from the mean of the held keys."""

    name: str = "outlier"

    def score(self, view: LayerView) -> Tensor:
        k = view.keys[..., 0]
        return (k - k.mean(dim=-1, keepdim=True)).abs()


def one_head(keys: list[float]) -> LayerView:
    k = torch.tensor(keys, dtype=torch.float).view(1, 1, -1, 1)
    t = k.shape[2]
    return LayerView(0, 1, t, k, torch.zeros_like(k), torch.arange(t).view(1, 1, t), {}, {})


def test_each_block_is_chosen_against_the_survivors_not_the_whole_prompt_by_hand():
    """Keys 0 10 1 2 9 3, keep 2, blocks of 2. Start: tokens 0 1. Block 2-3: candidates 0 10 1 2 (mean 3.25, distances
    3.25 6.75 2.25 1.25) keep tokens 0 and 1; block 4-5: 0 10 9 3 (mean 5.5: 5.5 4.5 3.5 2.5) keep 0 and 1 again.
    The whole prompt at once (mean 4.17: 4.17 5.83 3.17 2.17 4.83 1.17) would keep 1 and 4."""
    view = one_head([0, 10, 1, 2, 9, 3])
    assert Block(inner=Outlier(), budget=2, block=2).select(view, 2).tolist() == [[[0, 1]]]
    assert Outlier(budget=2).select(view, 2).tolist() == [[[1, 4]]]
    # a scorer that does not look at the others (the lowest norm) keeps the same either way
    assert Block(inner=KNorm(), budget=2, block=2).select(view, 2).tolist() == KNorm().select(view, 2).tolist()


def test_a_scorer_that_needs_attention_observed_is_refused():
    with pytest.raises(ConfigError, match="snapkv needs attention observed over the whole prompt, not per block"):
        Block(inner=SnapKV(), budget=0.25).validate(256)
    with pytest.raises(ConfigError, match="^block=0"):
        Block(inner=KNorm(), budget=0.25, block=0).validate(256)


def test_the_command_line_runs_block_over_keydiff(tmp_path):
    r = tiny_row(tmp_path, 'variants=["block(keydiff)@0.5"]')
    assert r["variant"] == "block(keydiff)@0.5"
    assert r["tokens_held_per_layer"] == [math.ceil(0.5 * r["context_tokens"])] * 3
