"""Backends without an engine: variant names, the block arithmetic of KV bytes, fidelity over shared positions, and
the configuration refusals that come before anything loads (exit 2, one line)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from evalkit.arch import Arch
from evalkit.backends.agreement import full_vocabulary, shared_positions, top_tokens
from evalkit.backends.kvbytes import block_bytes, declared_bytes, per_element, row_bytes
from evalkit.backends.llamacpp import CacheTypes, parse_variant, state_caches, state_kv_bytes
from evalkit.cli.precheck import precheck
from evalkit.config.choices import check_choices
from evalkit.errors import ConfigError
from tests.conftest import run_cli

# SmolLM2-135M: 30 layers, 3 KV heads of 64 dimensions (its config.json)
SMOLLM2 = Arch("smollm2", 30, 9, 3, 64, 576, 49152, True, (False,) * 30, None, None, 8192)
# Gemma-3-270M: 18 layers, every sixth global, the others a 512-token window; 1 KV head of 256 dimensions
GEMMA = Arch("gemma3", 18, 4, 1, 256, 640, 262144, True, tuple((i + 1) % 6 != 0 for i in range(18)), 512, None, 32768)


def test_llamacpp_variants_name_key_and_value_types():
    assert parse_variant("llamacpp:q8_0") == CacheTypes("llamacpp:q8_0", "q8_0", "q8_0")
    assert parse_variant("llamacpp:k=q8_0/v=q4_0") == CacheTypes("llamacpp:k=q8_0/v=q4_0", "q8_0", "q4_0")
    assert parse_variant("llamacpp:q8_0/q4_0") == CacheTypes("llamacpp:q8_0/q4_0", "q8_0", "q4_0")
    assert parse_variant("llamacpp:k=q4_0") == CacheTypes("llamacpp:k=q4_0", "q4_0", "f16")
    assert parse_variant("llamacpp:v=q8_0") == CacheTypes("llamacpp:v=q8_0", "f16", "q8_0")


@pytest.mark.parametrize(
    "spec, said",
    [
        ("llamacpp:q3_0", "is not one of"),
        ("q8_0", "is not a llama.cpp cache type"),
        ("llamacpp:f16", "baseline's own f16 cache"),
        ("llamacpp:k=q8_0/v=int4", "is not one of"),
    ],
)
def test_llamacpp_variant_refusals(spec, said):
    with pytest.raises(ConfigError, match=said):
        parse_variant(spec)


def test_block_formats_take_their_published_bytes():
    # q8_0: 32 int8 codes + one fp16 scale = 34 bytes; q4_0: 16 bytes of nibbles + the scale = 18; f16: 2 per value
    assert row_bytes("q8_0", 192) == 6 * 34
    assert row_bytes("q4_0", 192) == 6 * 18
    assert row_bytes("f16", 192) == 384
    assert per_element("q8_0") == 34 / 32 and per_element("q4_0") == 18 / 32 and per_element("fp8") == 1.0
    with pytest.raises(ConfigError, match="does not divide"):
        row_bytes("q8_0", 100)


def test_kv_bytes_of_smollm2_by_hand():
    # per token and layer one row of 3 x 64 = 192 keys and one of values: f16 768 bytes, q8_0 408, q4_0 216
    assert block_bytes(SMOLLM2, 100, "f16", "f16") == 30 * 100 * 768
    assert block_bytes(SMOLLM2, 100, "q8_0", "q8_0") == 30 * 100 * 408
    assert block_bytes(SMOLLM2, 100, "q8_0", "q4_0") == 30 * 100 * (204 + 108)
    assert declared_bytes(SMOLLM2, 100, "fp8") == 30 * 100 * 384
    assert declared_bytes(SMOLLM2, 100, "bfloat16") == 30 * 100 * 768


def test_llamacpp_state_headers_are_taken_off():
    # 8 bytes, then per cache 16, 12 per cell (position, sequence count, sequence id), 24 per layer (K and V: type, row
    # size); Gemma-3's sliding cache writes only the 512 cells its window sees (figures read off a real Gemma-3 run:
    # 1053 tokens, state 11,118,388 bytes, KV 11,099,136 = (3 x 1053 + 15 x 512) x 1024 f16 bytes)
    assert state_kv_bytes(8 + 16 + 12 * 10 + 24 * 30 + 1000, state_caches(SMOLLM2, 10)) == 1000
    assert state_caches(GEMMA, 1053) == [(1053, 3), (512, 15)]
    assert state_kv_bytes(11_118_388, state_caches(GEMMA, 1053)) == (3 * 1053 + 15 * 512) * 1024


def test_shared_positions_end_at_the_first_different_token():
    assert shared_positions([1, 2, 3], [1, 2, 3]) == 3
    assert shared_positions([1, 2, 3], [1, 5, 3]) == 2  # the second position was still conditioned on the same [1]
    assert shared_positions([1, 2], [1, 2, 3, 4]) == 2
    assert shared_positions([], [1]) == 0


def test_full_vocabulary_fidelity_by_hand():
    p = np.log(np.array([0.5, 0.25, 0.25]))
    q = np.log(np.array([0.25, 0.5, 0.25]))
    out = full_vocabulary([p, p], [q, q], [0, 1], [1, 1])  # they differ at the first token: one shared position
    kl = 0.5 * math.log(2) + 0.25 * math.log(0.5) + 0.0
    assert out["positions"] == 1
    assert out["top1_agreement"] == 0.0
    assert out["kl_mean"] == pytest.approx(kl)
    same = full_vocabulary([p], [p + 3.0], [0], [0])  # logits shifted by a constant: the same distribution
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] == pytest.approx(0.0, abs=1e-12)


def test_top_token_fidelity_renormalizes_over_the_tokens_both_returned():
    base = [{"7": math.log(0.6), "8": math.log(0.3), "9": math.log(0.1)}]
    var = [{"7": math.log(0.5), "8": math.log(0.5), "x": math.log(0.01)}]
    out = top_tokens(base, var, ["7"], ["7"])
    p, q = (0.6 / 0.9, 0.3 / 0.9), (0.5, 0.5)  # over {"7", "8"}
    assert out["top1_agreement"] == 1.0
    assert out["kl_mean"] == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q, strict=True)))
    assert out["tokens_compared"] == 2


NEEDLE = ["task.context_lengths=[256]", "task.depths=[0.5]"]


@pytest.mark.parametrize(
    "args, said",
    [
        (["backend=llamacpp"], "give them as 'variants=[llamacpp:q8_0"),
        (["backend=llamacpp", "variants=[llamacpp:q4_0]", "backend.flash_attn=false"], "only with flash attention"),
        (["backend=llamacpp", "variants=[snapkv@0.5]"], "is not a llama.cpp cache type"),
        (["backend=llamacpp", "variants=[llamacpp:q8_0]", "quant=int8"], "drop quant="),
        (["backend=llamacpp", "variants=[llamacpp:q8_0]", "model=tiny-random"], "is not one evalkit ships as GGUF"),
        (["backend=llamacpp", "variants=[llamacpp:q8_0]", "backend.n_batch=0"], "backend.n_batch=0"),
        (["backend=openai"], "needs the baseline's server"),
        (["backend=openai", "backend.endpoints={baseline:'http://127.0.0.1:1/v1',x:'ftp://a'}"], "not an http(s)"),
        (["backend=openai", "backend.endpoints={baseline:'http://a:1/v1',mine:'http://a:2/v1'}"], "declare the KV"),
        (
            ["backend=openai", "backend.endpoints={baseline:'http://a:1/v1',fp8:'http://a:2/v1'}", "backend.retry=3"],
            "unknown key backend.retry",
        ),
        (
            ["backend=openai", "backend.endpoints={baseline:'http://a:1/v1',fp8:'http://a:2/v1'}", "variants=[x@1]"],
            "takes its variants from backend.endpoints",
        ),
    ],
)
def test_backend_configuration_is_refused_before_anything_loads(args, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        precheck([*args, *NEEDLE])


def test_a_backend_that_needs_a_continuation_task_is_refused():
    with pytest.raises(ConfigError, match="teacher-forced"):
        precheck(["backend=llamacpp", "variants=[llamacpp:q8_0]", "task=fidelity"])


def test_a_misspelt_backend_names_the_near_one():
    with pytest.raises(ConfigError, match="did you mean llamacpp"):
        check_choices(["backend=lamacpp"])


def test_a_backend_refusal_is_exit_2_in_one_line(tmp_path):
    result = run_cli("backend=llamacpp", "variants=[llamacpp:q9_0]", *NEEDLE, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "llama.cpp cache type 'q9_0' is not one of" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_sliding_window_layers_hold_at_most_their_window():
    gemma = GEMMA
    per_token_layer = 2 * 256 * 2  # keys and values, f16
    assert block_bytes(gemma, 100, "f16", "f16") == 18 * 100 * per_token_layer
    assert block_bytes(gemma, 2000, "f16", "f16") == (3 * 2000 + 15 * 512) * per_token_layer
