"""What the KV arithmetic needs from a model's config (Arch), and the KV bytes per token, per sequence and per
storage format that follow from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from evalkit.errors import ConfigError

# Bytes per element of a weight or KV dtype (int4: two codes a byte).
ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class Arch:
    """What the KV and weight arithmetic needs from a Hugging Face config."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    tied: bool
    sliding: tuple[bool, ...]  # per layer: a sliding-window layer
    window: int | None  # the sliding layers' window in tokens
    mla: tuple[int, int] | None  # (kv_lora_rank, qk_rope_head_dim) of an MLA model
    max_context: int | None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sliding_layers(self) -> int:
        return sum(self.sliding)

    @property
    def per_layer_elements(self) -> int:
        """Elements one layer caches per token: keys and values of every KV head, or MLA's latent and RoPE key."""
        if self.mla:
            return self.mla[0] + self.mla[1]
        return 2 * self.kv_heads * self.head_dim

    @property
    def vector(self) -> int:
        """Elements of one cached vector (a KV head's key, or MLA's latent and RoPE key): what one scale covers."""
        return self.mla[0] + self.mla[1] if self.mla else self.head_dim


def _text_config(raw: dict) -> dict:
    """A multimodal config's language model part (Gemma 3, Llama 4, ...); the config itself otherwise."""
    inner = raw.get("text_config")
    return {**raw, **inner} if isinstance(inner, dict) and "num_hidden_layers" not in raw else raw


def _sliding(cfg: dict, layers: int) -> tuple[bool, ...]:
    """Which layers use a sliding window: `layer_types` where declared; Gemma 2 alternates (even layers sliding);
    an older Gemma 3 config declares a pattern (every n-th layer global); a config with use_sliding_window false
    (Qwen2) has none; otherwise a declared sliding_window applies to every layer (Mistral)."""
    if not cfg.get("sliding_window"):
        return (False,) * layers
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(t == "sliding_attention" for t in types)
    if cfg.get("model_type") == "gemma2":
        return tuple(i % 2 == 0 for i in range(layers))
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return tuple((i + 1) % pattern != 0 for i in range(layers))
    if cfg.get("use_sliding_window") is False:
        return (False,) * layers
    return (True,) * layers


def _head_dim(hidden: int, heads: int, name: str) -> int:
    """hidden / heads, which must divide (a config with no head_dim)."""
    if heads > 0 and hidden % heads:
        raise ConfigError(
            f"model {name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and the config "
            "gives no head_dim; fix the config (or give head_dim)"
        )
    return hidden // heads if heads > 0 else 0


def _check_heads(name: str, layers: int, heads: int, kv_heads: object, head_dim: object) -> None:
    """Layers and heads that a transformer can have: positive counts, KV heads dividing the query heads."""
    counts = (("num_hidden_layers", layers), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
    for key, value in counts:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"model {name}: {key}={value!r} in its config; give a whole number >= 1")
    if kv_heads > heads or heads % kv_heads:
        raise ConfigError(
            f"model {name}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads} (each KV head "
            "serves a whole group of query heads, at most all of them); fix the config"
        )
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ConfigError(f"model {name}: head_dim={head_dim!r} in its config; give a whole number >= 1")


# The config's other counts the planner reads (arch_from_config, evalkit.params), each the least it may be where
# given: a string, a float, a bool or a negative count is refused rather than read as something else.
COUNTS = {
    "vocab_size": 1,
    "intermediate_size": 1,
    "moe_intermediate_size": 1,
    "max_position_embeddings": 1,
    "sliding_window": 0,
    "sliding_window_pattern": 0,
    "kv_lora_rank": 0,
    "qk_rope_head_dim": 0,
    "qk_nope_head_dim": 0,
    "v_head_dim": 1,
    "q_lora_rank": 0,
    "n_routed_experts": 0,
    "num_local_experts": 0,
    "num_experts": 0,
    "n_shared_experts": 0,
    "num_experts_per_tok": 1,
    "first_k_dense_replace": 0,
}


def _check_fields(cfg: dict, name: str, layers: int) -> None:
    """The config's other fields are what they claim: counts whole numbers, tie_word_embeddings a boolean,
    layer_types one attention type (a string) per layer; a ConfigError naming the first that is not."""
    for key, least in COUNTS.items():
        value = cfg.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ConfigError(f"model {name}: {key}={value!r} in its config; give a whole number >= {least}")
    tied = cfg.get("tie_word_embeddings")
    if tied is not None and not isinstance(tied, bool):
        raise ConfigError(f"model {name}: tie_word_embeddings={tied!r} in its config; give true or false")
    types = cfg.get("layer_types")
    if types is not None and (
        not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types)
    ):
        got = f"a list of {len(types)}" if isinstance(types, list) else type(types).__name__
        raise ConfigError(
            f"model {name}: layer_types is {got} in its config, not one attention type per layer of its "
            f'{layers} (num_hidden_layers), e.g. "sliding_attention" or "full_attention"; fix the config'
        )


def arch_from_config(raw: dict, name: str) -> Arch:
    """The Arch of a Hugging Face config dict; a ConfigError naming the first key it lacks."""
    cfg = _text_config(raw)

    def need(*keys: str) -> int:
        for k in keys:
            if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool):
                return int(cfg[k])
        raise ConfigError(f"model {name}: its config has no {keys[0]} (a whole number); is it a causal LM's config?")

    layers, heads, hidden = (
        need("num_hidden_layers", "n_layer"),
        need("num_attention_heads", "n_head"),
        need("hidden_size", "n_embd", "d_model"),
    )
    kv_heads = heads if cfg.get("num_key_value_heads") is None else cfg["num_key_value_heads"]  # 0 is refused
    head_dim = cfg.get("head_dim") or _head_dim(hidden, heads, name)
    _check_heads(name, layers, heads, kv_heads, head_dim)
    _check_fields(cfg, name, layers)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = (int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0))
    sliding = _sliding(cfg, layers)
    return Arch(
        name=name,
        layers=layers,
        heads=heads,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        hidden=hidden,
        vocab=int(cfg.get("vocab_size") or 0),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        sliding=sliding,
        window=int(cfg["sliding_window"]) if any(sliding) else None,
        mla=mla,
        max_context=cfg.get("max_position_embeddings"),
        raw=cfg,
    )


def element_bytes(dtype: str) -> float:
    if dtype not in ELEMENT:
        raise ConfigError(f"dtype {dtype!r} is not one of {list(ELEMENT)}")
    return ELEMENT[dtype]


def kv_bytes_per_token(arch: Arch, dtype: str = "bfloat16") -> float:
    """KV bytes one token takes over all layers, in `dtype`, elements only (no quantization scales): 2 x layers x
    KV heads x head_dim x bytes, or layers x (kv_lora_rank + qk_rope_head_dim) x bytes for MLA. A sliding layer
    takes this much for each token within its window."""
    return arch.layers * arch.per_layer_elements * element_bytes(dtype)


# Storage formats of the capacity table: bytes per element, and the per-vector scale overhead of evalkit's layouts
# (conf/quant): FP8 one fp16 scale per token and KV head; int4/int8 KIVI an fp16 scale and minimum per 64 elements.
FORMATS = {
    "bf16": (2.0, lambda vector: 0.0),
    "fp8": (1.0, lambda vector: 2.0 / vector),
    "int8": (1.0, lambda vector: 4.0 / 64),
    "int4": (0.5, lambda vector: 4.0 / 64),
}


def format_bytes(arch: Arch, fmt: str, kv_dtype: str = "bfloat16") -> float:
    """Bytes per cached element in a storage format, its scales included (`bf16`: the full cache's kv_dtype)."""
    if fmt == "bf16":
        return element_bytes(kv_dtype)
    codes, overhead = FORMATS[fmt]
    return codes + overhead(arch.vector)


def kv_bytes_per_sequence(
    arch: Arch, context: int, per_element: float = 2.0, window: bool = True, budget: float = 1.0
) -> float:
    """KV bytes one sequence of `context` tokens holds: full-attention layers every token (times an eviction
    `budget`, the share kept), sliding layers at most their window (`window=False`: as if every layer were full)."""
    per_layer = arch.per_layer_elements * per_element
    total = 0.0
    for sliding in arch.sliding:
        if sliding and window:
            total += min(context, arch.window) * per_layer
        else:
            total += budget * context * per_layer
    return total
