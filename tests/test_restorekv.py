"""RestoreKV (kvpress's RestoreKVPress): the restore pass against a forward with the adapter merged into the weights,
the question's attention against plain attention over the kept and the restore tokens, the budget shared by hand,
and its refusals. The identity test and the cache invariants cover it with every policy in conf/policy
(tests/test_cache_invariants.py); kvpress's choices and restore tokens on the real model in tests/test_peer_kvpress.py.
The tiny model has 3 layers of 2 KV heads (4 query heads), hidden size 64; CTX = 96 context tokens."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AttentionInterface, DynamicCache

from evalkit.attention.sdpa import observe
from evalkit.engine.engine import prefill, reconstruction
from evalkit.errors import ConfigError
from evalkit.policies.kvzip import KVzip
from evalkit.policies.restorekv import Lora, Restore, RestoreKV, read_pass, read_restore
from tests.conftest import CTX, QUESTION, WEIGHTS_TINY, compressed, run_cli, sliding_model
from tests.test_cache_invariants import MASKS, masked_attention

N = 8  # restore tokens in tests/data/restorekv_tiny


def strong(model, seed: int = 0) -> Restore:
    """Restore embeddings and an adapter on every attention projection, drawn so that the adapter moves the keys
    and values by a tenth or so of their size (the seeded start of `python -m evalkit.calibrate restorekv` barely
    moves them)."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj"):
            a = torch.randn(2, module.in_features, generator=g) / module.in_features**0.5
            lora[name] = Lora(a, torch.randn(module.out_features, 2, generator=g) * 0.5, 1.5)
    return Restore(torch.randn(N, model.config.hidden_size, generator=g), lora, {})


def test_the_restore_pass_equals_a_forward_with_the_adapter_merged_into_the_weights(tiny, ids):
    """The restore tokens' keys and values: the context prefilled by the plain model, then the restore embeddings fed
    at positions 96 .. 103 over that cache by a copy of the model whose adapted weights are W + scaling x B A (how
    PEFT merges an adapter), with transformers' own cache. Control: without the adapter they differ."""
    restore = strong(tiny.model)
    full, _ = prefill(tiny.model, ids[:, :CTX])
    got = read_pass(tiny.model, full, restore.embeddings, restore.lora)
    merged = copy.deepcopy(tiny.model)
    with torch.no_grad():
        for name, pair in restore.lora.items():
            merged.get_submodule(name).weight += pair.scaling * pair.b @ pair.a
        cache = DynamicCache(config=merged.config)
        tiny.model(input_ids=ids[:, :CTX], cache=cache, use_cache=True)
        positions = torch.arange(CTX, CTX + N)[None]
        merged(inputs_embeds=restore.embeddings[None], position_ids=positions, cache=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        torch.testing.assert_close(got[i][0], layer.keys[:, :, CTX:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[i][1], layer.values[:, :, CTX:], rtol=1e-5, atol=1e-5)
    assert full.get_seq_length() == CTX, "the pass leaves the full cache as it was"
    plain = read_pass(tiny.model, full, restore.embeddings, {})
    assert not torch.allclose(plain[1][0], got[1][0], atol=1e-3)


def test_the_context_kept_is_kvzips_at_the_budget_less_the_restore_tokens(tiny, ids):
    """restorekv@40 keeps what kvzip@32 keeps of the context (the same scores ranked over all layers and heads, 8 of
    each head's 40 slots left to the restore tokens), then each head holds the 8 restore tokens at positions 96 ..
    103, and the question starts at 104. In all 40 x 2 heads x 3 layers = 240 tokens."""
    _, ours = compressed(tiny.model, ids, RestoreKV(budget=40, weights_path=str(WEIGHTS_TINY["restorekv"])))
    _, theirs = compressed(tiny.model, ids, KVzip(budget=32))
    assert ours.get_seq_length() == CTX + N
    assert sum(int(layer.tokens().sum()) for layer in ours.layers) == 240
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        for head_a, head_b in zip(a.positions[0], b.positions[0], strict=True):
            context = sorted(p for p in head_a.tolist() if 0 <= p < CTX)
            assert context == sorted(p for p in head_b.tolist() if p >= 0)
            assert head_a.tolist()[-N:] == list(range(CTX, CTX + N))


def test_the_question_attends_to_the_kept_and_the_restore_tokens_as_plain_attention_does(tiny, ids):
    """The question's logits after restorekv@0.5: plain attention, per layer and query head, over the whole context,
    the restore tokens (from the pass, at positions 96 .. 103) and the question (from 104), with the context tokens
    each KV head evicted masked out."""
    pol = RestoreKV(budget=0.5, weights_path=str(WEIGHTS_TINY["restorekv"]))
    full, cache = compressed(tiny.model, ids, pol)
    restore = pol.restore
    added = read_pass(tiny.model, full, restore.embeddings, restore.lora)
    n, hq = CTX + N + QUESTION, tiny.model.config.num_attention_heads
    reference = DynamicCache(config=tiny.model.config)
    for i, layer in enumerate(cache.layers):
        kept = torch.zeros(1, layer.positions.shape[1], CTX + N + 1, dtype=torch.bool)
        kept = kept.scatter_(2, layer.positions + 1, True)[..., 1:]  # padding (-1) lands in the dropped column
        assert kept[..., CTX:].all() and not kept[..., :CTX].all()
        mask = torch.ones(1, hq, QUESTION, n).tril(CTX + N).bool()
        mask[..., : CTX + N] &= kept.repeat_interleave(hq // kept.shape[1], dim=1)[:, :, None, :]
        MASKS[i] = mask
        full_layer = full.layers[i]
        keys, values = torch.cat([full_layer.keys, added[i][0]], 2), torch.cat([full_layer.values, added[i][1]], 2)
        reference.update(keys, values, i)
    with torch.inference_mode():
        got = tiny.model(input_ids=ids[:, CTX:], cache=cache, use_cache=True, **observe(None, cache)).logits[0]
        model = copy.deepcopy(tiny.model)
        AttentionInterface.register("evalkit_test_masked", masked_attention)
        model.set_attn_implementation("evalkit_test_masked")
        positions = torch.arange(CTX + N, n)[None]
        want = model(input_ids=ids[:, CTX:], position_ids=positions, cache=reference).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_one_pass_serves_every_variant_of_the_same_folder(tiny, ids):
    """Two budgets of the same folder need one restore pass; another folder, its own."""
    a = RestoreKV(budget=0.25, weights_path=str(WEIGHTS_TINY["restorekv"]))
    b = RestoreKV(budget=0.5, weights_path=str(WEIGHTS_TINY["restorekv"]))
    for pol in (a, b):
        pol.prepare(tiny.model, None)
    full, obs = prefill(tiny.model, ids[:, :CTX], [a, b])
    seconds = reconstruction(tiny.model, full, ids[:, :CTX], None, [a, b], obs)
    assert sorted(o.pass_name for o in seconds) == ["reconstruct", "restore"]


def folder_with(tmp_path, change) -> str:
    """A copy of tests/data/restorekv_tiny changed by `change(folder)`."""
    folder = tmp_path / "restorekv"
    shutil.copytree(WEIGHTS_TINY["restorekv"], folder)
    change(folder)
    return str(folder)


def set_config(**fields):
    def change(folder):
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **fields}))

    return change


def rename_modules(folder):
    path = str(folder / "adapter_model.safetensors")
    save_file({k.replace("layers.0.", "layers.9."): v for k, v in load_file(path).items()}, path)


def wider_embeddings(folder):
    save_file({"restore_embeddings": torch.zeros(N, 17)}, str(folder / "restore_embeddings.safetensors"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (set_config(use_dora=True), "the adapter sets use_dora, which evalkit does not apply"),
        (set_config(lora_alpha="x"), "adapter_config.json is not a LoRA adapter's configuration"),
        (rename_modules, "the adapter names model.layers.9.self_attn.k_proj, which this model does not have"),
        (wider_embeddings, "restore_embeddings of shape (17,), the model needs (hidden size) = (64,)"),
        (lambda folder: (folder / "adapter_model.safetensors").unlink(), "no LoRA adapter in adapter_config.json"),
    ],
)
def test_a_folder_that_is_not_this_models_restorekv_is_refused_naming_it(tiny, tmp_path, change, message):
    path = folder_with(tmp_path, change)
    with pytest.raises(ConfigError) as err:
        read_restore(path, tiny.model)
    assert message in str(err.value) and str(err.value).startswith(f"weights_path='{path}': ")
    assert "huggingface-cli download higokri/RestoreKV-<model>" in str(err.value)


def test_refusals_before_any_sample(tmp_path):
    """No folder, a folder without embeddings, and a model with sliding-window layers: one line each."""
    with pytest.raises(ConfigError, match="restorekv needs its restore tokens and adapter: give weights_path"):
        RestoreKV(budget=0.25).check_params()
    with pytest.raises(ConfigError, match="no restore embeddings in restore_embeddings.safetensors"):
        RestoreKV(budget=0.25, weights_path=str(tmp_path)).check_params()
    with pytest.raises(ConfigError, match="restorekv needs every layer to attend to the whole context"):
        RestoreKV(budget=0.25, weights_path=str(WEIGHTS_TINY["restorekv"])).prepare(sliding_model(), None)


def test_the_command_line_refuses_restorekv_without_its_folder(tmp_path):
    got = run_cli("policy=restorekv", "model=tiny-random", f"results_root={tmp_path}")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines()[-1].startswith("evalkit: error: restorekv needs its restore tokens")
