"""per_layer: any scorer with a budget of its own per evicting layer (kvpress's PerLayerCompressionPress), by hand on
the tiny random Llama (3 layers), end to end through the command line, and its one-line refusals; kvpress's choices
on the real model in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig

from evalkit.errors import ConfigError
from evalkit.kv.cache import held_per_layer
from evalkit.policies.per_layer import PerLayer, evicting_layers
from evalkit.policies.snapkv import SnapKV
from evalkit.records import SAMPLES, read_rows
from tests.conftest import CTX, compressed, run_cli

FRACTIONS = [0.75, 0.5, 0.25]  # the tiny model's 3 layers; mean 0.5


def test_each_layer_keeps_its_own_fraction_and_the_inner_policys_choice_within_it(tiny, ids):
    """Layer i keeps ceil(f_i x CTX) tokens, and they are the inner SnapKV's top set at that count: the same tokens
    as SnapKV alone at budget ceil(f_i x CTX) on that layer."""
    pol = PerLayer(inner=SnapKV(window=8), budget=0.5, layer_budgets=FRACTIONS)
    pol.validate(CTX)
    _, cache = compressed(tiny.model, ids, pol)
    want = [math.ceil(f * CTX) for f in FRACTIONS]
    assert held_per_layer(cache) == want
    for i, k in enumerate(want):
        _, alone = compressed(tiny.model, ids, SnapKV(budget=k, window=8))
        assert cache.layers[i].positions.tolist() == alone.layers[i].positions.tolist()


def test_an_empty_list_is_the_inner_policy_as_it_is(tiny, ids):
    _, cache = compressed(tiny.model, ids, PerLayer(inner=SnapKV(window=8), budget=0.25))
    _, alone = compressed(tiny.model, ids, SnapKV(budget=0.25, window=8))
    assert [lay.positions.tolist() for lay in cache.layers] == [lay.positions.tolist() for lay in alone.layers]


@pytest.mark.parametrize(
    ("fractions", "budget", "message"),
    [
        ([0.75, 0.5, 0.25], 0.25, "budget=0.25 is not the mean of layer_budgets (0.5); give budget=0.5"),
        ([0.75, 1.5, 0.25], 0.5, "give one fraction in (0, 1] per evicting layer"),
    ],
)
def test_budgets_that_do_not_add_up_are_refused(fractions, budget, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        PerLayer(inner=SnapKV(), budget=budget, layer_budgets=fractions).validate(128)


def test_the_command_line_runs_it_and_refuses_a_list_of_the_wrong_length_before_any_sample(tmp_path):
    args = ["model=tiny-random", "policy=per_layer", "task.context_lengths=[128]", "task.depths=[0.5]"]
    ok = run_cli(*args, "policy.budget=0.5", "policy.layer_budgets=[0.75,0.5,0.25]", f"hydra.run.dir={tmp_path / 'a'}")
    assert ok.returncode == 0, ok.stderr
    rows = {r["variant"]: r for r in read_rows(tmp_path / "a" / SAMPLES)}
    (name,) = set(rows) - {"baseline"}
    assert name.startswith("per_layer(snapkv)")
    n = rows[name]["context_tokens"]  # 128; a layer never keeps fewer than SnapKV's window (32) plus one
    assert rows[name]["tokens_held_per_layer"] == [max(math.ceil(f * n), 33) for f in FRACTIONS] == [96, 64, 33]
    bad = run_cli(*args, "policy.budget=0.5", "policy.layer_budgets=[0.5,0.5]", f"hydra.run.dir={tmp_path / 'b'}")
    assert bad.returncode == 2, bad.stderr
    assert "lists 2 fractions for the model's 3 evicting layers" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "b" / SAMPLES).exists()


def test_the_layers_counted_are_those_the_engines_cache_holds_whole():
    """Llama: every layer; Gemma 3 (12 layers, every 6th global): 2; Mistral with a sliding window on every layer:
    none, so no list but an empty one fits it."""
    llama = SimpleNamespace(config=LlamaConfig(num_hidden_layers=3))
    gemma = SimpleNamespace(config=Gemma3TextConfig(num_hidden_layers=12))
    mistral = SimpleNamespace(config=MistralConfig(num_hidden_layers=4, sliding_window=64))
    assert [evicting_layers(m) for m in (llama, gemma, mistral)] == [3, 2, 0]
