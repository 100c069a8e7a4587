"""Quantized KV storage on the tiny random Llama: packed bytes as held (the residual in the deployment dtype),
dequantized values within their quantization step of the originals, attention over the store equal to SDPA over the
dequantized tensors on every path (observed or not), the CPU's dequantized copy equal to the packed kernels, and
composition with eviction.

Tolerances: two computations of the same attention in float32 over the same values (SDPA vs the kernels' online
softmax) differ only in summation order, a few float32 ulps per term over ~100 tokens: atol 1e-5 on O(1) outputs and
logits. Dequantized values are bounded per element by the stored scales (half a step) plus the fp16 roundings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from evalkit import kernels
from evalkit.attention.observation import StepRecorder
from evalkit.attention.sdpa import causal_tail_mask, evalkit_sdpa, observe
from evalkit.cli.config import quant_spec
from evalkit.engine.engine import greedy, run_sample
from evalkit.errors import ConfigError
from evalkit.kernels import naive
from evalkit.kv.cache import EvictingLayer, fp16_bytes, held_per_layer, kv_bytes, share
from evalkit.kv.quantized import Fp8Layer, QuantizedLayer, QuantSpec, attention_path, quantize_cache
from evalkit.kv.variant import Variant
from evalkit.tasks.prompt import Prompt
from tests.conftest import CTX, QUESTION, compose_config, compressed, policy

GROUP, RESIDUAL = 16, 8  # the tiny model's head_dim is 16
STEPS = 8  # decoded tokens
FP8 = QuantSpec("fp8", 8, format="e4m3")
ATOL = 1e-5  # same math in float32, another summation order (module docstring)


@pytest.fixture(autouse=True)
def quick_quantize(monkeypatch):
    """Quantize and dequantize with the PyTorch references: the Triton ones (tests/test_kernels.py checks them
    against these) take ~1 s a launch in the interpreter. Decode attention keeps the path each test names."""
    monkeypatch.setattr(kernels, "quantize", naive.quantize)
    monkeypatch.setattr(kernels, "dequantize", naive.dequantize)


def spec(bits: int, cpu_path: str = "dequantized-cache") -> QuantSpec:
    return QuantSpec(f"int{bits}", bits, GROUP, RESIDUAL, cpu_path=cpu_path)


# every attention path the CPU can take; packed int4 runs the Triton kernel under TRITON_INTERPRET=1
SPECS = {
    "int4-cached": spec(4),
    "int4-packed": spec(4, "packed"),
    "fp8-cached": FP8,
    "fp8-packed": replace(FP8, cpu_path="packed"),
}


def quantized(model, ids, quant, pol=None):
    full, cache = compressed(model, ids, pol or policy("none", 1.0))
    return full, quantize_cache(cache, spec(quant) if isinstance(quant, int) else quant)


class Dequantized(EvictingLayer):
    """The reference: a layer whose attention is plain SDPA over `store.dequantized()` after every update."""

    def __init__(self, store):
        super().__init__(*store.dequantized(), store.seen)
        self.store = store

    def update(self, key_states, value_states, *args, **kwargs):
        self.store.update(key_states, value_states)
        self.seen = self.store.seen
        self.keys, self.values = self.store.dequantized()
        return self.keys, self.values


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_held_bytes_are_the_packed_tensors_scales_minima_and_residual(tiny, ids, bits):
    cfg = tiny.model.config
    full, cache = quantized(tiny.model, ids, bits)
    n_q = (CTX - RESIDUAL) // GROUP * GROUP  # whole groups only; the rest stays in the residual
    h, d, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    per_layer = (
        h * d * n_q * bits // 8
        + 2 * h * d * (n_q // GROUP) * 2  # keys: codes + fp16 scale and minimum per channel
        + h * n_q * d * bits // 8
        + 2 * h * n_q * (d // GROUP) * 2  # values: codes + fp16 scale and min per token
        + 2 * h * (CTX - n_q) * d * 2  # residual keys and values, fp16 (the float32 model's deployment dtype)
    )
    assert kv_bytes(cache) == layers * per_layer
    assert all(isinstance(layer, QuantizedLayer) and layer.quantized == n_q for layer in cache.layers)
    assert all(layer.keys.dtype == torch.float16 for layer in cache.layers)
    assert held_per_layer(cache) == [CTX] * layers
    # per fp16 value: bits/16 for the codes, 4 bytes of scale and minimum per 16-value group, 16 of 96 tokens in fp16
    assert kv_bytes(cache) / fp16_bytes(cache) == pytest.approx(80 / 96 * (bits / 16 + 2 / 16) + 16 / 96)


@pytest.mark.parametrize(
    ("dtype", "stored", "path"),
    [
        (torch.float32, torch.float16, "dequantized-cache"),
        (torch.float16, torch.float16, "packed-triton"),
        (torch.bfloat16, torch.bfloat16, "packed-triton"),  # the copy would round what the kernel reads in fp32
    ],
)
def test_residual_is_held_in_the_deployment_dtype_and_read_in_the_models(dtype, stored, path):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 40, 16, generator=g).to(dtype) for _ in range(2))
    layer = QuantizedLayer(EvictingLayer(k, v, 40), spec(4))
    assert (layer.keys.dtype, layer.values.dtype, layer.attention_path) == (stored, stored, path)
    assert all(x.dtype == dtype for x in layer.dequantized())
    keys, values = layer.update(k[:, :, :QUESTION], v[:, :, :QUESTION])  # several tokens: SDPA in the model's dtype
    assert keys.dtype == values.dtype == dtype and keys.shape[2] == 40 + QUESTION
    fp8 = Fp8Layer(EvictingLayer(k, v, 40), FP8)  # FP8's copy is what every step would dequantize, in any dtype
    assert fp8.attention_path == "dequantized-cache" and all(
        x.dtype == dtype for x in fp8.update(k[:, :, :1], v[:, :, :1])
    )


# tokens -> int4 bytes / fp16 bytes, by hand: (n_q / 4 + n_q / 32 + residual) / tokens, n_q = (tokens - 16) // 64 * 64
INT4_RATIO = {2048: 622 / 2048, 2064: 592 / 2064, 2071: 599 / 2071, 2127: 655 / 2127}


@pytest.mark.parametrize("tokens", list(INT4_RATIO))
def test_int4_bytes_at_2k_tokens_on_smollm2s_shape(tokens):
    """conf/quant/int4.yaml (group 64, residual 16) on one SmolLM2-135M layer (3 KV heads x 64 dims; all 30 are
    alike), bytes derived by hand. Per fp16 value: codes 1/4, scales and minima 4 bytes per 64 values (1/32), the
    residual (16 to 79 tokens, fp16) 1. At 2071 tokens, the needle context where a float32 residual made it 0.3003x
    (BENCHMARKS.md), 23 tokens stay in the residual: 0.289x. Over a flush cycle near 2k the ratio runs from 0.287x
    (2064 tokens, 16 in the residual) to 0.308x (2127, 79): <= 0.30x while the residual holds <= 53 tokens; 0.304x at
    exactly 2048 tokens (64 in it)."""
    int4 = quant_spec(compose_config("quant=int4").quant)
    assert (int4.bits, int4.group, int4.residual) == (4, 64, 16)
    h, d = 3, 64
    g = torch.Generator().manual_seed(0)
    full = EvictingLayer(torch.randn(1, h, tokens, d, generator=g), torch.randn(1, h, tokens, d, generator=g), tokens)
    layer = QuantizedLayer(full, int4)
    n_q = (tokens - 16) // 64 * 64
    residual = tokens - n_q
    codes = 2 * h * n_q * d // 2  # keys and values, two 4-bit codes a byte
    scales_minima = 2 * 2 * (h * n_q * d // 64) * 2  # keys and values: a scale and a minimum per 64 values, fp16
    held = codes + scales_minima + 2 * h * residual * d * 2  # residual keys and values in fp16
    fp16 = 2 * h * tokens * d * 2
    assert layer.quantized == n_q and layer.nbytes() == held
    ratio = kv_bytes(Cache(layers=[layer])) / fp16_bytes(Cache(layers=[layer]))
    assert ratio == held / fp16 == pytest.approx(INT4_RATIO[tokens], rel=1e-12)
    if residual <= 53:
        assert ratio <= 0.30


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantized_store_is_within_half_a_step_of_the_originals(tiny, ids, bits):
    """Per element, from the stored scales: |dequantized - original| <= scale / 2, plus the fp16 roundings (half an
    ulp, 2**-11 relative) of the stored minimum and of the input itself (held as fp16 before it is flushed), plus
    float32 rounding of the dequantization; the residual is the input rounded to fp16, exactly."""
    full, cache = quantized(tiny.model, ids, bits)
    for original, layer in zip(full.layers, cache.layers, strict=True):
        n, k, v = layer.quantized, original.keys, original.values
        keys, values = layer.dequantized()
        per_token = {  # (B, Hkv, T, D) scale and minimum of every quantized element
            "k": [x.float().repeat_interleave(GROUP, -1).transpose(-1, -2) for x in (layer.k_scale, layer.k_min)],
            "v": [x.float().repeat_interleave(GROUP, -1) for x in (layer.v_scale, layer.v_min)],
        }
        for name, got, want in (("k", keys, k), ("v", values, v)):
            scale, mn = per_token[name]
            x = want[:, :, :n]
            bound = scale / 2 + 2**-11 * (mn.abs() + x.abs()) + 2**-22 * (x.abs() + scale)
            assert bool(((got[:, :, :n] - x).abs() <= bound).all()), f"{name}: beyond half a step"
            assert torch.equal(got[:, :, n:], want[:, :, n:].half().float())
        assert bool((layer.k_scale > 0).all()), "random keys: no constant group, every step is positive"


def test_fp8_store_is_within_e4m3_rounding_of_the_originals(tiny, ids):
    """e4m3 keeps 3 mantissa bits: a code is within half its spacing of x / scale, 2**-4 relative for normal codes
    and 2**-10 (half the subnormal step 2**-9) below; times the stored fp16 scale, plus float32 rounding."""
    full, cache = quantized(tiny.model, ids, FP8)
    for original, layer in zip(full.layers, cache.layers, strict=True):
        for got, x, scale in zip(
            layer.dequantized(), (original.keys, original.values), (layer.k_scale, layer.v_scale), strict=True
        ):
            bound = torch.maximum(2**-4 * x.abs(), 2**-10 * scale.float()) + 2**-22 * x.abs()
            assert bool(((got - x).abs() <= bound).all())


@pytest.mark.parametrize("tq", [1, QUESTION], ids=["decode", "question"])
@pytest.mark.parametrize("name", list(SPECS))
def test_attention_over_the_store_is_sdpa_over_the_dequantized_tensors(tiny, ids, name, tq):
    """Through the attention function the model calls, on new tokens: equal to SDPA over everything the layer holds,
    dequantized; and far from SDPA over the newest tokens only (a layer that ignored its packed history)."""
    _, cache = quantized(tiny.model, ids, SPECS[name])
    module, cfg = tiny.model.model.layers[0].self_attn, tiny.model.config
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(tq)
    q = torch.randn(1, cfg.num_attention_heads, tq, cfg.head_dim, generator=g)
    k, v = (torch.randn(1, cfg.num_key_value_heads, tq, cfg.head_dim, generator=g) for _ in range(2))
    with torch.inference_mode():
        keys, values = layer.update(k, v)
        held = layer.held
        mask = causal_tail_mask(tq, held, q.device)
        out, _ = evalkit_sdpa(module, q, keys, values, mask, scaling=module.scaling, **observe(None, cache))
        dk, dv = layer.dequantized()
        want, _ = sdpa_attention_forward(
            module, q, dk, dv, causal_tail_mask(tq, held, q.device), scaling=module.scaling
        )
        newest, _ = sdpa_attention_forward(
            module, q, dk[:, :, -tq:], dv[:, :, -tq:], causal_tail_mask(tq, tq, q.device), scaling=module.scaling
        )
    assert dk.shape[2] == held == CTX + tq
    torch.testing.assert_close(out, want, rtol=0, atol=ATOL)
    assert (out - newest).abs().max() > 0.1


def test_a_decode_step_that_does_not_name_a_packed_store_is_refused(tiny, ids):
    """One token decoded over the packed store without observe(): its update returns only the residual, which plain
    SDPA would attend alone, so the layer refuses the forward; the dequantized-cache path returns every token and
    runs."""
    _, packed = quantized(tiny.model, ids, spec(4, "packed"))
    _, cached = quantized(tiny.model, ids, spec(4))
    step = ids[:, CTX : CTX + 1]
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match=r"QuantizedLayer without observe\(recorder, cache\)"):
            tiny.model(input_ids=step, cache=packed, use_cache=True)
        tiny.model(input_ids=step, cache=cached, use_cache=True)


@pytest.mark.parametrize("name", list(SPECS))
def test_quantized_layers_own_their_attention_observed_or_not(tiny, ids, name):
    """The question then STEPS teacher-forced tokens (flushing a group on the way), with no observer (the forward names
    its cache only): the logits of SDPA over the dequantized store at every step, and exactly those of the same forwards
    observed."""
    _, cache = quantized(tiny.model, ids, SPECS[name])
    reference = Cache(layers=[Dequantized(layer) for layer in share(cache).layers])
    observed = share(cache)
    forced = torch.randint(3, 200, (1, STEPS), generator=torch.Generator().manual_seed(1))
    inputs = [ids[:, CTX:], *forced.split(1, dim=1)]

    def run(c, watch=False):
        with torch.inference_mode():
            out = []
            for x in inputs:
                kw = observe(StepRecorder() if watch else None, c)
                out.append(tiny.model(input_ids=x, cache=c, use_cache=True, **kw).logits[0].float())
            return out

    got, want, seen = run(cache), run(reference), run(observed, watch=True)
    layer = cache.layers[0]
    assert isinstance(layer, Fp8Layer) or layer.quantized > (CTX - RESIDUAL) // GROUP * GROUP, "a group was flushed"
    for a, b, c in zip(got, want, seen, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
        assert torch.equal(a, c)


@pytest.mark.parametrize(("bits", "kernel"), [(8, "reference"), (4, "triton"), (4, "reference"), (2, "reference")])
def test_cached_path_equals_the_packed_kernels_in_a_decode_loop(tiny, ids, monkeypatch, bits, kernel):
    """The CPU's dequantized copy and the packed store read by the decode kernel (Triton, interpreted, or the PyTorch
    reference) decode the same tokens with the same logits, and each outcome records its path. The question leaves
    16 + 7 = 23 residual tokens: the first decode step flushes a group."""
    if kernel == "reference":
        monkeypatch.setattr(kernels, "use_triton", lambda x: False)
    assert kernels.use_triton(ids) == (kernel == "triton"), "the tests run Triton's interpreter (TRITON_INTERPRET=1)"
    prompt = Prompt(ids, CTX, [], "query_agnostic")
    none = policy("none", 1.0)
    variants = [Variant(none, spec(bits)), Variant(none, spec(bits, "packed"))]
    baseline, (cached, packed) = run_sample(tiny.model, prompt, variants, STEPS, set())
    assert (baseline.attention_path, cached.attention_path) == ("dense", "dequantized-cache")
    assert packed.attention_path == f"packed-{kernel}"
    assert cached.tokens == packed.tokens and len(cached.tokens) == STEPS
    for a, b in zip(cached.logits, packed.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_fp8_cached_copy_equals_dequantizing_every_step(tiny, ids):
    prompt = Prompt(ids, CTX, [], "query_agnostic")
    variants = [Variant(policy("none", 1.0), FP8), Variant(policy("none", 1.0), SPECS["fp8-packed"])]
    _, (cached, every_step) = run_sample(tiny.model, prompt, variants, 8, set())
    assert (cached.attention_path, every_step.attention_path) == ("dequantized-cache", "packed-reference")
    assert cached.tokens == every_step.tokens
    for a, b in zip(cached.logits, every_step.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_quantization_composes_with_eviction(tiny, ids):
    pol = policy("snapkv", 0.5)
    _, evicted = compressed(tiny.model, ids, pol)
    kept_positions = [layer.positions.clone() for layer in evicted.layers]
    both = quantize_cache(evicted, spec(2))
    assert held_per_layer(both) == pol.keep_per_layer(CTX, len(both.layers))
    assert all(torch.equal(layer.positions, p) for layer, p in zip(both.layers, kept_positions, strict=True))
    assert kv_bytes(both) < kv_bytes(evicted) * 0.5  # tiny groups and a 16-token fp16 residual of 48
    prompt = Prompt(ids, CTX, [], "query_agnostic")
    baseline, (out,) = run_sample(tiny.model, prompt, [Variant(pol, spec(2))], 4, set())
    assert out.variant == "snapkv@0.5+int2" and out.kv_bytes < baseline.kv_bytes * 0.5 * 0.5
    assert out.kv_bytes_fp16 == baseline.kv_bytes_fp16 // 2 and out.tokens_held == held_per_layer(both)


def test_decode_time_eviction_on_quantized_storage_is_a_config_error():
    from evalkit.cli.config import variants

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
    with pytest.raises(ConfigError, match="quant.cpu_path='gpu'"):
        QuantSpec("int4", 4, cpu_path="gpu").validate()


def test_fp8_storage_holds_codes_and_a_scale_per_token(tiny, ids):
    _, cache = quantized(tiny.model, ids, FP8)
    cfg = tiny.model.config
    h, d, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    assert all(isinstance(layer, Fp8Layer) for layer in cache.layers)
    assert kv_bytes(cache) == layers * 2 * h * CTX * (d * 1 + 2)  # one byte a value, an fp16 scale a token
    greedy(tiny.model, cache, ids[:, CTX:], 4, set())
    assert held_per_layer(cache) == [CTX + QUESTION + 3] * layers  # new tokens are stored as FP8 too
    assert kv_bytes(cache) == layers * 2 * h * (CTX + QUESTION + 3) * (d + 2)  # not the CPU's dequantized copy
    assert attention_path(cache) == "dequantized-cache"


def test_fp8_scales_are_safe_for_near_zero_and_zero_tokens():
    """A token whose largest |x| is far below fp16's range once had a scale that rounded to 0 (NaN codes). Bounds from
    the formats: e4m3 keeps 3 mantissa bits (rounding error <= 2**-4 of the value), its smallest subnormal code is
    2**-9, and a scale floored at fp16's smallest normal (2**-14) dequantizes anything below 2**-9 * 2**-14 to 0."""
    from evalkit.kv.quantized import to_fp8

    x = torch.zeros(1, 1, 3, 8)
    x[0, 0, 1] = 1e-9 * torch.arange(1, 9)  # near zero: amax / 448 is 1.8e-11, below fp16's subnormals
    x[0, 0, 2] = torch.linspace(-3.0, 5.0, 8)  # an ordinary token
    codes, scale = to_fp8(x)
    back = codes.float() * scale.float()
    assert torch.isfinite(back).all() and (scale > 0).all()
    assert back[0, 0, 0].abs().max() == 0  # the zero token comes back as zeros
    assert back[0, 0, 1].abs().max() <= 8e-9  # below 2**-23: dequantized to 0, off by at most its own size
    assert (back[0, 0, 2] - x[0, 0, 2]).abs().max() <= 5.0 * (2**-4 + 2**-10)  # amax x (e4m3 + fp16 scale rounding)
