"""Quantized KV storage on the tiny random Llama: packed bytes as held, a working decode loop, 8-bit logits close
to full precision, composition with eviction, and the Triton path equal to the reference path."""

from __future__ import annotations

import pytest
import torch

from evalkit import kernels
from evalkit.cache import held_per_layer, kv_bytes
from evalkit.engine import Variant, greedy, run_sample
from evalkit.errors import ConfigError
from evalkit.prompt import Prompt
from evalkit.quantized import QuantizedLayer, QuantSpec, quantize_cache
from tests.conftest import CTX, QUESTION, compose_config, compressed, policy

GROUP, RESIDUAL = 16, 8  # the tiny model's head_dim is 16


def spec(bits: int) -> QuantSpec:
    return QuantSpec(f"int{bits}", bits, GROUP, RESIDUAL)


def quantized(model, ids, bits, pol=None):
    full, cache = compressed(model, ids, pol or policy("none", 1.0))
    return full, quantize_cache(cache, spec(bits))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_held_bytes_are_the_packed_tensors_scales_minima_and_residual(tiny, ids, bits):
    cfg = tiny.model.config
    full, cache = quantized(tiny.model, ids, bits)
    n_q = (CTX - RESIDUAL) // GROUP * GROUP  # whole groups only; the rest stays in full precision
    h, d, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    per_layer = (
        h * d * n_q * bits // 8
        + 2 * h * d * (n_q // GROUP) * 2  # keys: codes + fp16 scale and minimum per channel
        + h * n_q * d * bits // 8
        + 2 * h * n_q * (d // GROUP) * 2  # values: codes + fp16 scale and min per token
        + 2 * h * (CTX - n_q) * d * 4  # residual keys and values, float32
    )
    assert kv_bytes(cache) == layers * per_layer
    assert all(isinstance(layer, QuantizedLayer) and layer.quantized == n_q for layer in cache.layers)
    assert held_per_layer(cache) == [CTX] * layers
    assert kv_bytes(cache) < kv_bytes(full) * {8: 0.5, 4: 0.4, 2: 0.3}[bits]  # fp32 baseline, tiny groups


def test_residual_is_flushed_in_whole_groups_while_decoding(tiny, ids):
    _, cache = quantized(tiny.model, ids, 4)
    residuals = []
    greedy(tiny.model, cache, ids[:, CTX:], 12, set(), lambda: residuals.append(cache.layers[0].keys.shape[-2]))
    assert all(RESIDUAL <= r < RESIDUAL + GROUP for r in residuals)
    layer = cache.layers[0]
    assert layer.quantized % GROUP == 0 and layer.held == layer.seen == cache.get_seq_length()
    assert layer.quantized > (CTX - RESIDUAL) // GROUP * GROUP, "decoding should have flushed a group"


def test_int8_logits_are_close_to_full_precision(tiny, ids):
    full, _ = compressed(tiny.model, ids, policy("none", 1.0))
    from evalkit.cache import share

    base = greedy(tiny.model, share(full), ids[:, CTX:], 8, set())
    _, cache = quantized(tiny.model, ids, 8)
    got = greedy(tiny.model, cache, ids[:, CTX:], 8, set())
    assert got.tokens == base.tokens
    for a, b in zip(got.logits, base.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


def test_triton_path_equals_the_reference_path_in_a_decode_loop(tiny, ids, monkeypatch):
    assert kernels.use_triton(ids), "the tests run Triton's interpreter on the CPU (TRITON_INTERPRET=1)"
    _, cache = quantized(tiny.model, ids, 4)
    triton_run = greedy(tiny.model, cache, ids[:, CTX:], 6, set())
    monkeypatch.setattr(kernels, "use_triton", lambda x: False)
    _, cache = quantized(tiny.model, ids, 4)
    reference_run = greedy(tiny.model, cache, ids[:, CTX:], 6, set())
    assert triton_run.tokens == reference_run.tokens
    for a, b in zip(triton_run.logits, reference_run.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_quantization_composes_with_eviction(tiny, ids):
    pol = policy("snapkv", 0.5)
    _, evicted = compressed(tiny.model, ids, pol)
    kept_positions = [layer.positions.clone() for layer in evicted.layers]
    both = quantize_cache(evicted, spec(2))
    assert held_per_layer(both) == pol.keep_per_layer(CTX, len(both.layers))
    assert all(torch.equal(layer.positions, p) for layer, p in zip(both.layers, kept_positions, strict=True))
    assert kv_bytes(both) < kv_bytes(evicted) * 0.5  # tiny groups and a 16-token fp32 residual of 48
    prompt = Prompt(ids, CTX, [], "query_agnostic")
    baseline, (out,) = run_sample(tiny.model, prompt, [Variant(pol, spec(2))], 4, set())
    assert out.variant == "snapkv@0.5+int2" and out.kv_bytes < baseline.kv_bytes * 0.5 * 0.5
    assert out.kv_bytes_fp16 == baseline.kv_bytes_fp16 // 2 and out.tokens_held == held_per_layer(both)


def test_decode_time_eviction_on_quantized_storage_is_a_config_error():
    from evalkit.config import variants

    with pytest.raises(ConfigError, match="set policy.decode=false"):
        variants(compose_config("policy=streaming_llm", "quant=int4"))
    assert [v.name for v in variants(compose_config("policy=none", "quant=int4"))] == ["none@1.0+int4"]
    names = [v.name for v in variants(compose_config("variants=[snapkv@0.25+int2,none@1.0+int8,knorm@0.5]"))]
    assert names == ["snapkv@0.25+int2", "none@1.0+int8", "knorm@0.5"]


@pytest.mark.parametrize(
    ("kw", "message"), [({"bits": 3}, "quant.bits=3"), ({"group": 48}, "power of two"), ({"residual": -1}, ">= 0")]
)
def test_quant_spec_errors(kw, message):
    with pytest.raises(ConfigError, match=message):
        QuantSpec(**{"name": "x", "bits": 4, **kw}).validate()
    with pytest.raises(ConfigError, match="must divide the model's head_dim=16"):
        QuantSpec("int4", 4, 64).validate(16)


def test_question_chunk_attends_over_the_dequantized_history(tiny, ids):
    """Several new tokens at once (the question) go through SDPA over the dequantized keys and values."""
    _, cache = quantized(tiny.model, ids, 8)
    layer = cache.layers[0]
    keys, values = layer.dequantized()
    assert keys.shape == (1, tiny.model.config.num_key_value_heads, CTX, tiny.model.config.head_dim)
    torch.testing.assert_close(keys[:, :, layer.quantized :], layer.keys)
    with torch.inference_mode():
        out = tiny.model(input_ids=ids[:, CTX:], cache=cache, use_cache=True).logits
    assert out.shape[1] == QUESTION and torch.isfinite(out).all()


def test_fp8_storage_holds_codes_and_a_scale_per_token(tiny, ids):
    from evalkit.cache import share
    from evalkit.quantized import Fp8Layer

    fp8 = QuantSpec("fp8", 8, format="e4m3")
    full, cache = compressed(tiny.model, ids, policy("none", 1.0))
    cache = quantize_cache(cache, fp8)
    cfg = tiny.model.config
    h, d, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    assert all(isinstance(layer, Fp8Layer) for layer in cache.layers)
    assert kv_bytes(cache) == layers * 2 * h * CTX * (d * 1 + 2)  # one byte a value, an fp16 scale a token
    base = greedy(tiny.model, share(full), ids[:, CTX:], 4, set())
    got = greedy(tiny.model, cache, ids[:, CTX:], 4, set())
    assert held_per_layer(cache) == [CTX + QUESTION + 3] * layers  # new tokens are stored as FP8 too
    for a, b in zip(got.logits, base.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0.1)


def test_fp8_scales_are_safe_for_near_zero_and_zero_tokens():
    """A token whose largest |x| is far below fp16's range once had a scale that rounded to 0 (NaN codes). Bounds from
    the formats: e4m3 keeps 3 mantissa bits (rounding error <= 2**-4 of the value), its smallest subnormal code is
    2**-9, and a scale floored at fp16's smallest normal (2**-14) dequantizes anything below 2**-9 * 2**-14 to 0."""
    from evalkit.quantized import to_fp8

    x = torch.zeros(1, 1, 3, 8)
    x[0, 0, 1] = 1e-9 * torch.arange(1, 9)  # near zero: amax / 448 is 1.8e-11, below fp16's subnormals
    x[0, 0, 2] = torch.linspace(-3.0, 5.0, 8)  # an ordinary token
    codes, scale = to_fp8(x)
    back = codes.float() * scale.float()
    assert torch.isfinite(back).all() and (scale > 0).all()
    assert back[0, 0, 0].abs().max() == 0  # the zero token comes back as zeros
    assert back[0, 0, 1].abs().max() <= 8e-9  # below 2**-23: dequantized to 0, off by at most its own size
    assert (back[0, 0, 2] - x[0, 0, 2]).abs().max() <= 5.0 * (2**-4 + 2**-10)  # amax x (e4m3 + fp16 scale rounding)
