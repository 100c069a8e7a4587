"""KVCompose (kvpress's KVComposePress, structured): the repeat's attention against eager attention over [context,
context], the composite ranking and each layer's count by hand, its refusals, end to end. The identity test and the
cache invariants cover it with every policy in conf/policy (tests/test_cache_invariants.py); kvpress's choices on
the real model in tests/test_peer_kvpress.py."""

from __future__ import annotations

import pytest
import torch

from evalkit.engine.engine import prefill, reconstruction
from evalkit.errors import ConfigError
from evalkit.policies import LayerView
from evalkit.policies.kvcompose import KVCompose, RepeatAttention
from tests.conftest import CTX, run_cli, sliding_model, tiny_row


@pytest.mark.parametrize("agg", ["max", "mean"])
def test_the_repeat_attention_equals_eager_attention_over_the_context_twice(tiny, eager, ids, agg):
    """Each query head's attention from the repeated context (positions n .. 2n - 1) to the first n tokens, over the
    queries: transformers' eager attention over the sequence [context, context]."""
    context = ids[:, :CTX]
    pol = KVCompose(budget=0.25, agg_task=agg)
    full, obs = prefill(tiny.model, context, [pol])
    reconstruction(tiny.model, full, context, None, [pol], obs)
    with torch.inference_mode():
        attentions = eager(input_ids=torch.cat([context, context], dim=1), output_attentions=True).attentions
    for layer, att in enumerate(attentions):
        rows = att[0][:, CTX:, :CTX]  # (Hq, repeated queries, context keys)
        want = rows.amax(dim=1) if agg == "max" else rows.mean(dim=1)
        torch.testing.assert_close(obs[layer][RepeatAttention(agg)][0], want, rtol=1e-4, atol=1e-6)


def view_with(layer: int, per_head: list[list[float]]) -> LayerView:
    """A layer of 2 KV heads of one query head each whose repeat attention is `per_head` (2 x T)."""
    scores = torch.tensor(per_head, dtype=torch.float32)[None]  # (1, Hq = 2, T)
    t = scores.shape[-1]
    keys = torch.zeros(1, 2, t, 1)
    return LayerView(layer, 2, t, keys, keys, torch.arange(t).expand(1, 2, t), {}, {RepeatAttention("max"): scores})


def test_layers_share_the_budget_by_composite_rank_and_each_head_keeps_its_own_best_by_hand():
    """Two layers, two KV heads, 4 tokens; no mean added across heads. Layer 0 heads score (4 3 2 1) and
    (1 1.5 1.2 5): sorted (4 3 2 1) and (5 1.5 1.2 1), composite (4.5 2.25 1.6 1). Layer 1: (9 0 0 0) and (0 0 8 0):
    composite (8.5 0 0 0); layer 0's becomes the highest of any layer at each rank: (8.5 2.25 1.6 1). A budget of 2
    per layer (4 ranks in all) takes 8.5, 8.5, 2.25 and 1.6: 3 for layer 0, 1 for layer 1. Layer 0's heads keep their
    best 3, (0 1 2) and (1 2 3); layer 1's their best 1, (0) and (2)."""
    pol = KVCompose(budget=2, add_mean_across_heads=False)
    views = {0: view_with(0, [[4, 3, 2, 1], [1, 1.5, 1.2, 5]]), 1: view_with(1, [[9, 0, 0, 0], [0, 0, 8, 0]])}
    kept = pol.select_layers(views, {0: 2, 1: 2})
    assert kept[0].tolist() == [[[0, 1, 2], [1, 2, 3]]]
    assert kept[1].tolist() == [[[0], [2]]]
    # with the mean across heads added, layer 1's heads score (9 0 4 0) and (4.5 0 12 0)
    assert KVCompose(budget=2).score(views[1]).tolist() == [[[13.5, 0.0, 4.0, 0.0], [4.5, 0.0, 12.0, 0.0]]]


def test_unstructured_every_head_of_every_layer_takes_its_own_count_by_hand():
    """Unstructured: each head's own sorted scores compete over both layers for 2 per layer x 2 heads = 8 ranks of
    the 16. Layer 0's heads score (4 3 2 1.1) and (1 1.5 0.5 5), sorted (4 3 2 1.1) and (5 1.5 1 0.5); layer 1's
    (9 0 0 0) and (0 0 8 0). The best 8: 9, 8, 5, 4, 3, 2, 1.5, 1.1: layer 0's first head 4 (all), its second 2 (5
    and 1.5: tokens 3 and 1), layer 1's heads 1 each."""
    pol = KVCompose(budget=2, add_mean_across_heads=False, structured=False)
    views = {0: view_with(0, [[4, 3, 2, 1.1], [1, 1.5, 0.5, 5]]), 1: view_with(1, [[9, 0, 0, 0], [0, 0, 8, 0]])}
    kept = pol.select_layers(views, {0: 2, 1: 2})
    assert kept[0].tolist() == [[[0, 1, 2, 3], [1, 3, -1, -1]]]  # heads of a layer differ: padded with -1
    assert kept[1].tolist() == [[[0], [2]]]
    assert pol.ragged and not KVCompose(budget=2).ragged


def test_what_it_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="kvcompose needs every layer to attend to the whole context"):
        KVCompose(budget=0.25).prepare(sliding_model(), None)
    with pytest.raises(ConfigError, match="^agg_head='median'"):
        KVCompose(budget=0.25, agg_head="median").validate(None)


def test_the_command_line_runs_it_and_refuses_decoding_in_one_line(tmp_path):
    row = tiny_row(tmp_path / "ok", "policy=kvcompose", "policy.budget=0.5")
    assert row["variant"] == "kvcompose@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
    row = tiny_row(tmp_path / "un", "policy=kvcompose", "policy.budget=0.5", "policy.structured=false")
    assert row["kv_bytes_deployed"] < row["kv_bytes_baseline"]  # ragged heads: the tokens held, not the padding
    result = run_cli("model=tiny-random", "policy=kvcompose", "policy.decode=true", f"hydra.run.dir={tmp_path / 'no'}")
    assert result.returncode == 2, result.stderr
    assert "kvcompose compresses once, after the prompt: set policy.decode=false" in result.stderr
