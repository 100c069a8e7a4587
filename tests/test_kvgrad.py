"""KVgrad (kvpress's KVgradPress): KVzip's reconstruction attention weighted by the values' output norms and by the
norm of the gradient of Phi = sum ||h_L||^2 at each probe's attention output, checked against transformers' eager
attention and autograd over the whole sequence, one sequence per chunk; its refusals; end to end. The identity test
and the cache invariants cover it with every policy in conf/policy (tests/test_cache_invariants.py); kvpress's
choices on the real model in tests/test_peer_kvpress.py."""

from __future__ import annotations

import pytest
import torch

from evalkit.engine.engine import prefill, reconstruction
from evalkit.errors import ConfigError
from evalkit.policies.kvgrad import GradReconstruction, KVgrad
from tests.conftest import policy, run_cli, sliding_model, tiny_row
from tests.test_kvzip import chat, chunk_sequences, prompt, value_output_norm  # noqa: F401 - fixtures by name


def recording(layers) -> tuple[dict, list]:
    """Forward hooks on `layers` recording each layer's attention output (with its graph), its values and the last
    layer's output (before the model's final norm)."""
    seen: dict = {"attn": {}, "values": {}, "last": None}
    hooks = []
    for j, layer in enumerate(layers):
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, j=j: seen["attn"].update({j: o[0]})))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(lambda m, a, o, j=j: seen["values"].update({j: o})))
    hooks.append(layers[-1].register_forward_hook(lambda m, a, o: seen.update(last=o)))
    return seen, hooks


def eager_kvgrad(eager, context, repeat, sinks, chunk, prev=8):
    """Per layer (Hkv, n): per chunk [lo, hi) of the context after the template opening, the sequence [context,
    repeat prompt, chunk] through eager attention with autograd from its embeddings: each probe p (the tokens after
    the context) scores the chunk's keys with its probabilities renormalised over the first min(sinks, lo) keys, the
    chunk's and the probes' keys, times ||W_O,h v|| of the key for query head h, times the norm of dPhi/da_p, a_p the
    layer's attention output at p and Phi the sum of the squared last-layer outputs over the probes; the max over
    probes and the group's query heads. Written from kvpress's description, not evalkit's code."""
    n = context.shape[1]
    cfg = eager.config
    hkv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    layers = eager.model.layers
    out = {i: torch.zeros(hkv, n) for i in range(len(layers))}
    for lo, hi, seq in chunk_sequences(context, repeat, chunk, prev):
        seen, hooks = recording(layers)
        try:
            with torch.enable_grad():
                embeds = eager.model.embed_tokens(seq).detach().requires_grad_(True)
                attentions = eager(inputs_embeds=embeds, output_attentions=True).attentions
                last = seen["last"][0] if isinstance(seen["last"], tuple) else seen["last"]
                phi = last[0, n:].square().sum()
                grads = torch.autograd.grad(phi, [seen["attn"][j] for j in range(len(layers))])
        finally:
            for hook in hooks:
                hook.remove()
        s = min(sinks, lo)
        cols = list(range(s)) + list(range(lo, hi)) + list(range(n, seq.shape[1]))
        for j, layer in enumerate(layers):
            p = attentions[j][0][:, n:][:, :, cols].detach()
            p = p / p.sum(-1, keepdim=True)
            v = seen["values"][j].detach().view(1, seq.shape[1], hkv, -1).transpose(1, 2)
            wov = value_output_norm(layer.self_attn, v[:, :, lo:hi], group).reshape(-1, hi - lo)  # (Hq, chunk)
            g = grads[j][0, n:].norm(dim=-1)  # (probes,)
            scored = p[:, :, s : s + hi - lo] * wov[:, None, :] * g[None, :, None]
            out[j][:, lo:hi] = scored.amax(dim=1).view(hkv, -1, hi - lo).amax(dim=1)
    return out


@pytest.mark.parametrize("chunk_size", [2048, 40], ids=["one-pass", "chunks-of-40"])
def test_scores_equal_eager_attention_times_autograd_gradients(tiny, eager, prompt, chunk_size):  # noqa: F811
    pol = policy("kvgrad", 0.25, chunk_size=chunk_size)
    context = prompt.ids[:, : prompt.n_context]
    full, obs = prefill(tiny.model, context, [pol])
    reconstruction(tiny.model, full, context, prompt.repeat, [pol], obs)
    want = eager_kvgrad(eager, context, prompt.repeat, 4, chunk_size)
    for layer, ref in want.items():
        torch.testing.assert_close(obs[layer][GradReconstruction(4, chunk_size)][0], ref, rtol=1e-3, atol=1e-6)
    assert any(bool((ref > 0).any()) for ref in want.values())


def test_a_model_with_sliding_window_layers_is_refused():
    with pytest.raises(ConfigError, match="kvgrad needs every layer to attend to the whole context"):
        KVgrad(budget=0.25).prepare(sliding_model(), None)
    with pytest.raises(ConfigError, match="^chunk_size=0"):
        KVgrad(budget=0.25, chunk_size=0).validate(None)


def test_the_command_line_runs_it_and_refuses_decoding_in_one_line(tmp_path):
    row = tiny_row(tmp_path / "ok", "policy=kvgrad", "policy.budget=0.5")
    assert row["variant"] == "kvgrad@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
    result = run_cli("model=tiny-random", "policy=kvgrad", "policy.decode=true", f"hydra.run.dir={tmp_path / 'no'}")
    assert result.returncode == 2, result.stderr
    assert "kvgrad compresses once, after the prompt: set policy.decode=false" in result.stderr
