"""KV bytes of another engine's cache, and where each figure comes from (the row's `kv_bytes_source`).

llama.cpp stores each layer's keys and values as rows of its cache type: a block format packs 32 values into a fixed
number of bytes (q8_0: 32 int8 codes and one fp16 scale, 34 bytes; q4_0: 16 bytes of 4-bit codes and the scale, 18).
The block sizes come from the `gguf` package (GGML_QUANT_SIZES), not from the engine being measured. A server's
cache is not observable over HTTP: its bytes follow from the KV dtype it was started with (`declared`) through
evalkit.plan's arithmetic.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from evalkit.arch import ELEMENT, Arch, kv_bytes_per_sequence
from evalkit.errors import ConfigError

# The cache types llama.cpp accepts for --cache-type-k / --cache-type-v
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

ENGINE_STATE = "llama.cpp state (llama_state_seq_get_size) less its per-token and per-layer headers"
FORMAT = "format blocks (gguf GGML_QUANT_SIZES): the engine reported no state size"
DECLARED = "declared"


def ggml_type(name: str) -> GGMLQuantizationType:
    """The GGML type of a llama.cpp cache type name (`q8_0`), or a ConfigError listing the valid ones."""
    if name not in CACHE_TYPES:
        raise ConfigError(f"llama.cpp cache type {name!r} is not one of {list(CACHE_TYPES)}")
    return GGMLQuantizationType[name.upper()]


def row_bytes(name: str, elements: int) -> int:
    """Bytes llama.cpp takes for `elements` values of cache type `name` (a whole number of blocks)."""
    block, size = GGML_QUANT_SIZES[ggml_type(name)]
    if elements % block:
        raise ConfigError(
            f"{name} packs {block} values a block; a row of {elements} values does not divide into blocks"
        )
    return elements // block * size


def per_element(dtype: str) -> float:
    """Bytes per cached value of a dtype evalkit.plan knows (float16, bfloat16, fp8, int8, int4) or of a llama.cpp
    cache type (q8_0: 34/32), elements only: a server's per-tensor scales are not counted."""
    if dtype in ELEMENT:
        return float(ELEMENT[dtype])
    if dtype in CACHE_TYPES:
        block, size = GGML_QUANT_SIZES[ggml_type(dtype)]
        return size / block
    raise ConfigError(f"KV dtype {dtype!r} is not one of {sorted(ELEMENT) + list(CACHE_TYPES)}")


def block_bytes(arch: Arch, tokens: int, k: str, v: str) -> int:
    """Bytes of a sequence of `tokens` tokens with keys of type k and values of type v: per layer and token one row of
    kv_heads x head_dim keys and one of values; a sliding-window layer holds at most its window."""
    width = arch.kv_heads * arch.head_dim
    held = sum(min(tokens, arch.window) if sliding and arch.window else tokens for sliding in arch.sliding)
    return held * (row_bytes(k, width) + row_bytes(v, width))


def declared_bytes(arch: Arch, tokens: int, dtype: str) -> int:
    """Bytes a server whose KV cache holds `dtype` takes for `tokens` tokens of one sequence (evalkit.plan: sliding
    layers hold at most their window)."""
    return round(kv_bytes_per_sequence(arch, tokens, per_element(dtype)))
