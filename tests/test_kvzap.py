"""KVzap (policies/kvzap.py): a learned surrogate per layer scores each token from the hidden state entering attention.

The hidden states against transformers' own (the model's output_hidden_states through each layer's input norm), the
surrogates' arithmetic by hand (linear) and against torch's modules (the MLP), the choice against a plain top-k of
the reference scores, the identity, and one-line refusals. The surrogates of tests/data/kvzap_tiny and
kvzap_smollm2 were fitted here (`python -m evalkit.calibrate kvzap`); kvpress's choices given the SmolLM2 folder are in
tests/test_peer_kvpress.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from evalkit.errors import ConfigError
from evalkit.kv.cache import held_positions
from evalkit.policies import LayerView
from evalkit.policies.kvzap import HiddenStates, KVzap, surrogates
from tests.conftest import CTX, WEIGHTS_TINY, attention_inputs_by_hand, compressed, run_cli


def write_surrogates(folder, tensors: dict, hidden_dim, n: int, d: int, h: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    spec = {"model_type": "kvzap", "input_dim": d, "output_dim": h, "n_modules": n, "hidden_dim": hidden_dim}
    (folder / "config.json").write_text(json.dumps(spec))
    return str(folder)


class Config:
    num_hidden_layers, hidden_size, num_key_value_heads = 1, 2, 2


def test_a_linear_surrogate_scores_by_hand_and_the_policy_keeps_each_heads_best(tmp_path):
    """W = [[1, 0], [0, -1]], b = [0, 1]: head 0 scores x0, head 1 scores 1 - x1. Hidden states (3, 0), (1, 5),
    (2, -1): head 0 scores 3, 1, 2 and keeps tokens 0 and 2; head 1 scores 1, -4, 2 and keeps 0 and 2 as well;
    with budget 1 head 0 keeps 0, head 1 keeps 2."""
    w = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    path = write_surrogates(
        tmp_path / "lin", {"layers.0.weight": w, "layers.0.bias": torch.tensor([0.0, 1.0])}, None, 1, 2, 2
    )
    layers, kind = surrogates(path, Config())
    hidden = torch.tensor([[[3.0, 0.0], [1.0, 5.0], [2.0, -1.0]]])
    assert kind == "linear"
    torch.testing.assert_close(layers[0](hidden).transpose(1, 2), torch.tensor([[[3.0, 1, 2], [1, -4, 2]]]))
    keys = torch.zeros(1, 2, 3, 4)
    view = LayerView(0, 1, 3, keys, keys, torch.arange(3).expand(1, 2, 3), {}, {HiddenStates(): hidden})
    pol = KVzap(budget=1, weights_path=path)
    pol.surrogates = layers
    assert pol.select(view, 2).tolist() == [[[0, 2], [0, 2]]]
    assert pol.select(view, 1).tolist() == [[[0], [2]]]


def test_an_mlp_surrogate_is_torchs_linear_gelu_linear(tmp_path):
    g = torch.Generator().manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.GELU(), torch.nn.Linear(5, 2))
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=g)
    tensors = {f"layers.0.{k}": v for k, v in mlp.state_dict().items()}  # layers.0.0.weight ... layers.0.2.bias
    layers, kind = surrogates(write_surrogates(tmp_path / "mlp", tensors, 5, 1, 2, 2), Config())
    x = torch.randn(1, 7, 2, generator=g)
    assert kind == "mlp"
    with torch.no_grad():
        torch.testing.assert_close(layers[0](x), mlp(x))


def test_the_hidden_states_are_what_each_attention_receives(tiny, ids):
    """Independently: the model's hidden states entering each decoder layer (output_hidden_states), through that
    layer's input norm, are what its attention receives."""
    context = ids[:, :CTX]
    got = HiddenStates().second_pass(tiny.model, None, context, None)
    for i, want in enumerate(attention_inputs_by_hand(tiny.model, context)):
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_on_the_model_each_head_keeps_the_top_k_of_the_surrogate_on_the_reference_hidden_states(tiny, ids):
    pol = KVzap(budget=24, weights_path=str(WEIGHTS_TINY["kvzap"]))
    _, cache = compressed(tiny.model, ids, pol)
    for i, hidden in enumerate(attention_inputs_by_hand(tiny.model, ids[:, :CTX])):
        scores = pol.surrogates[i](hidden).transpose(1, 2)  # (1, Hkv, T)
        want = scores.topk(24, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(held_positions(cache.layers[i]), want)


def test_keep_everything_is_the_full_cache(tiny, ids):
    full, cache = compressed(tiny.model, ids, KVzap(budget=1.0, weights_path=str(WEIGHTS_TINY["kvzap"])))
    for a, b in zip(cache.layers, full.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_weights_of_another_model_or_none_are_refused(tiny, tmp_path):
    with pytest.raises(ConfigError, match="kvzap needs its surrogate models: give weights_path="):
        KVzap().validate(None)
    smollm2 = str(WEIGHTS_TINY["kvzap"]).replace("kvzap_tiny", "kvzap_smollm2")
    with pytest.raises(ConfigError, match=r"surrogates of shape \(30, 576, 3\), the model needs .* = \(3, 64, 2\)"):
        KVzap(weights_path=smollm2).prepare(tiny.model, None)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="no KVzap config.json beside the weights"):
        KVzap(weights_path=str(tmp_path)).prepare(tiny.model, None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "kvzap needs its surrogate models: give policy.weights_path=DIR"),
        (["policy.decode=true"], "kvzap compresses once, after the prompt: set policy.decode=false"),
        (["prefill=chunked"], "kvzap does not support a chunked prefill"),
    ],
)
def test_what_it_cannot_run_is_refused_in_one_line(tmp_path, args, message):
    weights = [] if not args else [f"policy.weights_path={WEIGHTS_TINY['kvzap']}"]
    result = run_cli("model=tiny-random", "policy=kvzap", *weights, *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
