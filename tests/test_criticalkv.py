"""criticalkv and criticaladakv: an inner scorer's choice in two stages, the second weighted by the values'
output-projection norms (CriticalKV, kvpress's CriticalKVPress; within Ada-KV's head budgets), by hand, the norms
against a plain loop over the tiny model's own output projection, and end to end; kvpress's choices on the real model
in tests/test_peer_kvpress.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.adakv import AdaKV
from evalkit.policies.critical import CriticalKV, output_norms
from evalkit.policies.critical_ada import CriticalAdaKV
from tests.conftest import tiny_row


@dataclass(kw_only=True)
class FirstChannel(KVPolicy):
    """A scorer that ranks by the key's first channel."""

    name: str = "first_channel"

    def score(self, view: LayerView) -> Tensor:
        return view.keys[..., 0].float()


def test_the_first_stage_keeps_the_inner_best_and_the_rest_are_weighted_by_the_output_norm_by_hand():
    """One KV head, two query heads whose output projections scale a 1-dim value by 1 and 3: ||W_o,h v||_1 averaged
    is 2|v|. Inner scores 5 4 3 2 1, values 0.01 0.1 0.1 2 3: norms 0.02 0.2 0.2 4 6, weighted (s + 1e-4) x norm
    0.1 0.8 0.6 8 2 x 3 = 6. Keeping 3 with a first stage of half (int(1.5) = 1 token): token 0 (the inner best), then
    3 and 4. Without the first stage token 0 (0.1) would go for token 1 (0.8); the inner scores alone keep 0 1 2."""
    keys = torch.tensor([5.0, 4, 3, 2, 1]).view(1, 1, 5, 1)
    values = torch.tensor([0.01, 0.1, 0.1, 2, 3]).view(1, 1, 5, 1)
    view = LayerView(0, 1, 5, keys, values, torch.arange(5).view(1, 1, 5), {}, {})
    w_o = torch.tensor([[1.0, 3.0]])  # (hidden 1, 2 heads x 1 dim), as nn.Linear holds it
    torch.testing.assert_close(output_norms(values, w_o, 2)[0, 0], torch.tensor([0.02, 0.2, 0.2, 4, 6]))

    def chosen(first_stage: float) -> list:
        pol = CriticalKV(inner=FirstChannel(), budget=3, first_stage=first_stage)
        pol.w_o, pol.n_heads = {0: w_o}, 2
        return pol.select(view, 3).tolist()

    assert chosen(0.5) == [[[0, 3, 4]]]
    assert chosen(0.0) == [[[1, 3, 4]]]
    assert FirstChannel().select(view, 3).tolist() == [[[0, 1, 2]]]


def test_output_norms_equal_a_plain_loop_over_the_models_own_projection(tiny):
    """Per KV head and token: the mean over its query heads of sum_j |sum_d W_o[j, h D + d] v[d]|, written out."""
    attn = tiny.model.model.layers[1].self_attn
    cfg = tiny.model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    values = torch.randn(1, hkv, 6, d, generator=torch.Generator().manual_seed(0))
    w = attn.o_proj.weight.detach()  # (hidden, Hq x D)
    want = torch.zeros(1, hkv, 6)
    for g in range(hkv):
        for h in range(g * hq // hkv, (g + 1) * hq // hkv):
            want[0, g] += (values[0, g] @ w[:, h * d : (h + 1) * d].t()).abs().sum(dim=-1) / (hq // hkv)
    pol = CriticalKV(inner=FirstChannel(), budget=3)
    assert pol.prepare(tiny.model, None) is None and pol.n_heads == hq
    torch.testing.assert_close(output_norms(values, pol.w_o[1], hq), want, rtol=1e-5, atol=1e-5)


def test_unprepared_and_out_of_range_settings_are_refused():
    view = LayerView(0, 1, 2, torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1), torch.arange(2).view(1, 1, 2), {}, {})
    with pytest.raises(ValueError, match="prepare"):
        CriticalKV(inner=FirstChannel(), budget=1).select(view, 1)
    with pytest.raises(ConfigError, match="^first_stage=1.5"):
        CriticalKV(inner=FirstChannel(), budget=1, first_stage=1.5).validate(16)


def test_the_command_line_runs_criticalkv_over_snapkv(tmp_path):
    row = tiny_row(tmp_path, "variants=[criticalkv/snapkv@0.5]")
    assert row["variant"] == "criticalkv(snapkv)@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]


def test_criticaladakv_fills_adakvs_head_budgets_in_two_stages_by_hand():
    """Two KV heads of one query head each (W_o = [1, 1]: the norm is |v|), keeping 3 per head on average: 6 slots.
    Inner scores 10 9 8 7 1 0 and 5 2 1 0.5 0.4 0.3; each head's floor int(0.2 x 3) -> 1 token (its best). The top 6
    across heads: head 0's tokens 0-3 and head 1's 0-1, budgets 4 and 2. First stage (half): head 0 tokens 0 1, head 1
    token 0. Then (s + 1e-4) |v| with values 1 1 .01 .01 100 1 and 1 .001 1 1 1 1: head 0 adds 4 (100) and 2 (.08),
    head 1 adds 2 (1). Ada-KV alone keeps 0-3 and 0-1; CriticalKV alone (3 a head) keeps 0 1 4 and 0 2 3."""
    keys = torch.tensor([[10.0, 9, 8, 7, 1, 0], [5, 2, 1, 0.5, 0.4, 0.3]]).view(1, 2, 6, 1)
    values = torch.tensor([[1.0, 1, 0.01, 0.01, 100, 1], [1, 0.001, 1, 1, 1, 1]]).view(1, 2, 6, 1)
    view = LayerView(0, 1, 6, keys, values, torch.arange(6).expand(1, 2, 6), {}, {})
    w_o = torch.tensor([[1.0, 1.0]])

    def prepared(pol):
        pol.w_o, pol.n_heads = {0: w_o}, 2
        return pol

    both = prepared(CriticalAdaKV(inner=FirstChannel(), budget=3))
    assert (both.ragged, both.decodable, both.over(view, 3), both.over(view, 6)) == (True, False, True, False)
    assert both.select(view, 3).tolist() == [[[0, 1, 2, 4], [0, 2, -1, -1]]]
    assert AdaKV(inner=FirstChannel(), budget=3).select(view, 3).tolist() == [[[0, 1, 2, 3], [0, 1, -1, -1]]]
    assert prepared(CriticalKV(inner=FirstChannel(), budget=3)).select(view, 3).tolist() == [[[0, 1, 4], [0, 2, 3]]]
    with pytest.raises(ConfigError, match="^alpha=1.5"):
        CriticalAdaKV(inner=FirstChannel(), budget=1, alpha=1.5).validate(16)


def test_the_command_line_runs_criticaladakv_over_snapkv_with_uneven_heads(tmp_path):
    row = tiny_row(tmp_path, "variants=[criticaladakv/snapkv@0.5]")
    assert row["variant"] == "criticaladakv(snapkv)@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
