"""KV planning before validation: is KV memory the bottleneck, how many sequences each option buys, is offload viable.

    python -m evalkit.plan model=smollm2-135m [plan.gpu_gib=80] [plan.batch=32] [plan.context=8192]
    python -m evalkit.plan model=hf model.name_or_path=PATH/config.json plan.runs=[results/RUN1,results/RUN2]

Reads the model's config only, never its weights (a local folder or config.json, a cached Hub id, the embedded
models' converted folder or GGUF header, a tiny model's YAML), so it plans a 70B model on a laptop. Writes plan.json,
plan.md, plan.html (the tables and an interactive pressure plot, evalkit.plan_page) and plan_pressure.png into plan.out;
logger=wandb logs them. Exit codes as every evalkit command
(evalkit.errors): 0 done, 2 bad input (one line), 3 a bug.

The arithmetic, and where it comes from:
- KV bytes per token = 2 (keys and values) x layers x KV heads x head_dim x bytes per element (Pope et al. 2022,
  *Efficiently Scaling Transformer Inference*, arXiv:2211.05102); GQA and MQA through num_key_value_heads (Ainslie
  et al. 2023, arXiv:2305.13245; Shazeer 2019, arXiv:1911.02150).
- A sliding-window layer holds at most its window (Mistral 7B, Jiang et al. 2023, arXiv:2310.06825; Gemma 3's
  interleaved local/global layers, Gemma Team 2025, arXiv:2503.19786).
- MLA caches, per layer and token, the compressed latent (kv_lora_rank) and the decoupled RoPE key
  (qk_rope_head_dim), shared by all heads (DeepSeek-V2, arXiv:2405.04434, section 2.1.3).
- A decode step reads every weight once and every sequence's KV once: KV-bound when the KV bytes of the batch exceed
  the weight bytes (the memory-bound decode of Pope et al.). Paged KV allocates what a sequence holds, not its
  maximum context (PagedAttention, Kwon et al. 2023, arXiv:2309.06180); prefix caching holds a shared prefix once
  (RadixAttention, Zheng et al. 2024, arXiv:2312.07104).
The gate's capacity line (evalkit.gate) uses `capacity` here: the arithmetic exists once.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from evalkit import plan_page
from evalkit.errors import ConfigError
from evalkit.units import GiB, fmt_bytes  # binary units (KiB, MiB, GiB), one formatter

# Bytes per element of a weight or KV dtype (int4: two codes a byte).
ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
# One-way bandwidth in GB/s (1e9 bytes): PCIe x16 Gen4 16 GT/s x 16 lanes (31.5 GB/s after 128b/130b coding), Gen5 twice
# that; NVLink-C2C (Grace Hopper) 900 GB/s in both directions together, 450 each way.
LINKS = {"pcie4": 32.0, "pcie5": 64.0, "nvlink-c2c": 450.0}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
OUTPUTS = ("plan.json", "plan.md", "plan.html", "plan_pressure.png")


# --- the model's architecture, from its config --------------------------------------------------------------------


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


# --- KV bytes -------------------------------------------------------------------------------------------------------


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


# --- weights --------------------------------------------------------------------------------------------------------


def _mlp(cfg: dict, hidden: int, layer: int) -> tuple[int, int]:
    """(total, active per token) parameters of one layer's MLP: a gated MLP (3 matrices), or a mixture of experts
    (DeepSeek: routed and shared experts from first_k_dense_replace on; Mixtral/Qwen-MoE: num_local_experts)."""
    dense = 3 * hidden * int(cfg.get("intermediate_size") or 4 * hidden)
    routed = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    if not routed or layer < int(cfg.get("first_k_dense_replace") or 0):
        return dense, dense
    per_expert = 3 * hidden * int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size"))
    shared = int(cfg.get("n_shared_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 2)
    router = int(routed) * hidden
    return (int(routed) + shared) * per_expert + router, (top_k + shared) * per_expert + router


def _attention_params(arch: Arch) -> int:
    cfg, h = arch.raw, arch.hidden
    if arch.mla:
        rank, rope = arch.mla
        nope, v = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("v_head_dim") or arch.head_dim)
        q_rank = cfg.get("q_lora_rank")
        q = h * q_rank + q_rank + q_rank * arch.heads * (nope + rope) if q_rank else h * arch.heads * (nope + rope)
        return q + h * (rank + rope) + rank + rank * arch.heads * (nope + v) + arch.heads * v * h
    q_out = arch.heads * arch.head_dim
    return h * q_out + 2 * h * arch.kv_heads * arch.head_dim + q_out * h


def count_params(arch: Arch) -> tuple[int, int]:
    """(total, active per token) parameters computed from the config: embeddings (and an untied head), per layer the
    attention projections, the MLP or experts and two norms, a final norm. Biases are not counted."""
    h = arch.hidden
    embed = arch.vocab * h * (1 if arch.tied else 2)
    total = active = embed + h
    attention = _attention_params(arch) + 2 * h
    for layer in range(arch.layers):
        mlp_total, mlp_active = _mlp(arch.raw, h, layer)
        total += attention + mlp_total
        active += attention + mlp_active
    return total, active


def safetensors_params(path: Path) -> int:
    """Parameters of a .safetensors file from its header alone (8-byte length, then JSON): no tensor is read."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


STORED = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


def metadata_params(folder: Path | None, raw: dict) -> tuple[int, str] | None:
    """Parameters from a model folder's safetensors metadata: the index's total_size (bytes, in the stored dtype the
    config names), or a single file's header. None where the folder has neither."""
    if folder is None:
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        total = (json.loads(index.read_text()).get("metadata") or {}).get("total_size")
        stored = str(raw.get("torch_dtype") or raw.get("dtype") or "")
        if total and stored in STORED:
            return int(total) // STORED[stored], f"{index.name} total_size ({stored})"
    single = folder / "model.safetensors"
    if single.is_file():
        return safetensors_params(single), f"{single.name} header"
    return None


# --- reading a model's config without its weights -----------------------------------------------------------------


@dataclass
class Source:
    raw: dict
    where: str  # where the config was read, in words
    folder: Path | None = None  # a folder that may hold safetensors metadata
    params: tuple[int, str] | None = None  # parameters counted from file metadata, and where


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{what}: {path} is not readable JSON ({err}); give a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds no JSON object; give a Hugging Face config.json")
    return data


def read_source(model: DictConfig) -> Source:
    """The model's config dict, read without its weights, by model.kind."""
    kind = model.get("kind")
    if kind == "tiny-random":
        from transformers import AutoConfig

        from evalkit.models import byte_tokenizer

        raw = AutoConfig.for_model(
            model.architecture,
            vocab_size=len(byte_tokenizer()),
            max_position_embeddings=int(model.max_context),
            **OmegaConf.to_container(model.config),
        ).to_dict()
        return Source(raw, f"tiny-random {model.architecture} config (conf/model/{model.name}.yaml)")
    if kind == "gguf":
        return _gguf_source(model)
    if kind == "hf":
        return _hf_source(model)
    raise ConfigError(f"model.kind={kind!r} is not one of ['gguf', 'hf', 'tiny-random']")


def cache_root() -> Path:
    """evalkit.models.cache_root, without importing torch: where embedded models are converted."""
    import os

    from platformdirs import user_cache_dir

    return Path(os.environ.get("EVALKIT_CACHE") or user_cache_dir("evalkit")) / "models"


def _gguf_source(model: DictConfig) -> Source:
    """An embedded model: the folder evalkit converted it into (config.json and the safetensors header), else the
    GGUF file's header (its metadata and tensor shapes, not its tensor data)."""
    folder = cache_root() / f"{model.name}-{model.package_version}"
    if (folder / "config.json").is_file():
        raw = _read_json(folder / "config.json", f"model {model.name}")
        return Source(raw, f"converted folder {folder}", folder, metadata_params(folder, raw))
    import importlib.util
    import tempfile

    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {model.name} needs the package {model.package}; install it with: {model.pip_install}")
    with tempfile.TemporaryDirectory() as work:
        if model.get("assemble"):  # a chunked package: its own assemble() joins the file (no tensor is parsed)
            import importlib

            path = Path(importlib.import_module(model.module).assemble(Path(work) / model.gguf_file))
        else:
            path = Path(spec.submodule_search_locations[0]) / model.gguf_file
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        raw = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        params = sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
    return Source(raw, f"GGUF header of {model.gguf_file}", None, (params, "GGUF tensor shapes"))


def _hf_source(model: DictConfig) -> Source:
    """model.name_or_path: a config.json file, a local folder, or a Hub id (its config.json, from the local cache
    when offline)."""
    name = str(model.name_or_path)
    path = Path(name).expanduser()
    if path.is_file():
        raw = _read_json(path, "model.name_or_path")
        folder = path.parent if path.name == "config.json" else None
        return Source(raw, str(path), folder, metadata_params(folder, raw))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name_or_path={name!r} is a folder without config.json")
        raw = _read_json(path / "config.json", "model.name_or_path")
        return Source(raw, str(path / "config.json"), path, metadata_params(path, raw))
    from huggingface_hub import hf_hub_download

    try:
        config = Path(hf_hub_download(name, "config.json", revision=model.get("revision")))
    except Exception as err:  # noqa: BLE001 - not found, offline and not cached, a malformed id: all the user's to fix
        raise ConfigError(
            f"model.name_or_path={name!r}: no config.json here or in the Hub cache ({str(err).splitlines()[0]}); "
            "give a local folder or config.json, or a Hub id on a machine that reaches the Hub"
        ) from None
    raw = _read_json(config, "model.name_or_path")
    try:
        index = Path(hf_hub_download(name, "model.safetensors.index.json", revision=model.get("revision")))
        params = metadata_params(index.parent, raw)
    except Exception:  # noqa: BLE001 - a single-file or non-safetensors model: counted from the config
        params = None
    return Source(raw, f"{name} (Hub config.json)", None, params)


def model_label(model: DictConfig) -> str:
    if model.get("kind") == "hf":
        p = Path(str(model.name_or_path))
        return p.stem if p.suffix == ".json" and p.name != "config.json" else (p.name or str(model.name_or_path))
    return str(model.name)


# --- capacity, pressure, offload: the arithmetic --------------------------------------------------------------------


def free_bytes(gpu_gib: float, weights_bytes: float, utilization: float = 1.0) -> float:
    """Accelerator bytes left for KV: the usable share of the memory, less the weights."""
    return gpu_gib * GiB * utilization - weights_bytes


def sequences(free: float, per_sequence: float, shared: float = 0.0) -> int:
    """How many sequences of `per_sequence` KV bytes fit in `free` bytes; with prefix caching a share `shared` of
    every sequence is one prefix held once: shared x per_sequence once, then (1 - shared) x per_sequence each."""
    own = (1 - shared) * per_sequence
    room = free - shared * per_sequence
    return int(room // own) if own > 0 and room > 0 else 0


def capacity(summary: dict[str, Any], weights_bytes: int, gpu_gib: float, context: int) -> dict[str, Any]:
    """The gate's capacity line: how many sequences of `context` tokens fit in `gpu_gib` of accelerator memory after
    the weights, per variant, from the KV bytes per context token of the run as a deployment holds them (fp16/bf16,
    or packed)."""
    free = free_bytes(gpu_gib, weights_bytes)
    out = {}
    for name, s in summary.items():
        per_seq = s["kv_bytes_per_token"] * context
        out[name] = {
            "kv_bytes_per_token": s["kv_bytes_per_token"],
            "kv_bytes_per_sequence": per_seq,
            "sequences": sequences(free, per_seq),
        }
    return out


def pressure(arch: Arch, weights_bytes: float, batch: int, context: int, per_element: float = 2.0) -> dict:
    """KV bytes vs weight bytes read per decode step at `batch` sequences of `context` tokens."""
    kv = batch * kv_bytes_per_sequence(arch, context, per_element)
    ratio = kv / weights_bytes if weights_bytes > 0 else math.inf
    return {
        "batch": batch,
        "context": context,
        "kv_bytes": kv,
        "weights_bytes": weights_bytes,
        "ratio": ratio,
        "bound": "KV-bound" if ratio > 1 else "weight-bound",
    }


def crossover_context(arch: Arch, weights_bytes: float, batch: int, per_element: float = 2.0) -> float | None:
    """The context at which `batch` sequences' KV bytes equal the weight bytes (KV per sequence is piecewise linear
    in the context: sliding layers stop growing at their window); None where it never does (every layer sliding)."""
    target = weights_bytes / batch
    per_layer = arch.per_layer_elements * per_element
    full, slid = arch.layers - arch.sliding_layers, arch.sliding_layers
    w = arch.window or 0
    if slid and w and (full + slid) * per_layer * w >= target:
        return target / ((full + slid) * per_layer)
    if full == 0:
        return None
    return (target - slid * per_layer * w) / (full * per_layer)


def link_seconds(nbytes: float, gbps: float) -> float:
    """Seconds to move `nbytes` over a link of `gbps` GB/s (1e9 bytes a second)."""
    return nbytes / (gbps * 1e9)


def offload(kv_step_bytes: float, weights_bytes: float, hbm_gbps: float, link_gbps: float) -> dict[str, Any]:
    """KV offloaded to CPU memory, fetched over the link each decode step. The step computes in the time its reads
    take from GPU memory (weights and KV, memory-bound decode); the link must bring the cold KV in that time to hide
    it. Returns the read rate needed to stream all the KV, the step times, and the largest cold share hidden."""
    compute = link_seconds(weights_bytes + kv_step_bytes, hbm_gbps)
    on_link = link_seconds(kv_step_bytes, link_gbps)
    needed = kv_step_bytes / compute / 1e9 if compute > 0 else 0.0
    cold = min(1.0, compute * link_gbps * 1e9 / kv_step_bytes) if kv_step_bytes > 0 else 1.0
    if cold >= 1:
        verdict = (
            f"viable: the whole KV streams over the link within the step ({on_link * 1e3:.1f} ms <= "
            f"{compute * 1e3:.1f} ms)"
        )
    elif cold >= 0.1:
        verdict = (
            f"partly: at most {cold:.0%} of the KV can live in CPU memory without slowing the step; all of it would "
            f"make the step {on_link / compute:.1f}x slower"
        )
    else:
        verdict = (
            f"not viable: the link hides only {cold:.1%} of the KV; offloading all of it makes each step "
            f"{on_link / compute:.0f}x slower ({on_link * 1e3:.0f} ms vs {compute * 1e3:.1f} ms)"
        )
    return {
        "kv_step_bytes": kv_step_bytes,
        "link_gbps": link_gbps,
        "hbm_gbps": hbm_gbps,
        "compute_seconds": compute,
        "link_seconds": on_link,
        "step_seconds_all_offloaded": max(compute, on_link),
        "needed_gbps": needed,
        "cold_fraction": cold,
        "verdict": verdict,
    }


# --- measured variants from evalkit run folders ----------------------------------------------------------------------


def measured_variants(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """Each variant of each run folder: its KV bytes as a deployment holds them, their ratio to the full cache's
    (measured on the run's model), and the gate's verdict on it, judged here from the records (with the thresholds of
    the folder's verdict.json where it holds one, else conf/gate/default.yaml): a verdict.json is never believed."""
    from evalkit.analysis import is_baseline, summarize
    from evalkit.gate import VERDICT, judge, load_thresholds, read_runs, thresholds

    out = []
    for d in run_dirs:
        if not d.is_dir():
            raise ConfigError(f"plan.runs: {d} is not a folder; give evalkit run folders (results/...)")
        records = read_runs([d])
        if records.problems:
            raise ConfigError(f"plan.runs: {d}: {records.problems[0]}")
        if not records.rows:
            raise ConfigError(f"plan.runs: {d} holds no records (samples.jsonl); give a finished evalkit run")
        written = _read_verdict(d / VERDICT)
        t = thresholds(written["thresholds"], f"in {d / VERDICT}") if written else load_thresholds("default")
        verdict = judge(records.rows, records.infos, t)
        model = ((records.infos[0] if records.infos else {}).get("model") or {}).get("name")
        for name, s in summarize(records.rows).items():
            if is_baseline(name):
                continue
            status = ((verdict.variants.get(name) or {}).get("gate") or {}).get("status") or verdict.status
            failed = failed_cells({"cells": verdict.cells}, name)
            reasons = [r for r in verdict.reasons if r.startswith(f"{name}:")]
            why = f"on cells {', '.join(failed)}" if failed else (reasons[0] if reasons else "")
            if status != "FAIL" and verdict.status == "CANNOT JUDGE":
                status, why = "CANNOT JUDGE", (verdict.reasons or [""])[0]
            if not written:  # no thresholds to judge with but the default ones: say so
                why = "; ".join(filter(None, ["judged here at conf/gate/default.yaml", why]))
            out.append(
                {
                    "variant": name,
                    "run": str(d),
                    "model": model,
                    "n": s["n"],
                    "kv_ratio": s["kv_ratio"],
                    "kv_ratio_basis": s["kv_ratio_basis"],
                    "kv_bytes_per_token": s["kv_bytes_per_token"],
                    "status": status,
                    "why": why,
                }
            )
    return out


# --- the plan --------------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    gpu_gib: float
    utilization: float
    batch: int
    context: int
    p95_context: int
    weight_dtype: str
    weights_gib: float | None
    kv_dtype: str
    budgets: list[float]
    prefix_hit_rate: float
    link: str
    link_gbps: float | None
    hbm_gbps: float
    runs: list[str]
    out: str | None


def settings(node: DictConfig) -> Settings:
    """The plan node, checked: one ConfigError naming the key and the fix."""
    d = OmegaConf.to_container(node, resolve=True)
    unknown = set(d) - set(Settings.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown plan keys {sorted(unknown)}; valid: {sorted(Settings.__dataclass_fields__)}")
    s = Settings(**d)

    def positive(key: str, whole: bool = False) -> None:
        v = getattr(s, key)
        ok = isinstance(v, int) if whole else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or v <= 0:
            raise ConfigError(f"plan.{key}={v!r}: give a {'whole number' if whole else 'number'} > 0")

    for key in ("gpu_gib", "hbm_gbps"):
        positive(key)
    for key in ("batch", "context", "p95_context"):
        positive(key, whole=True)
    if not (isinstance(s.utilization, (int, float)) and 0 < s.utilization <= 1):
        raise ConfigError(f"plan.utilization={s.utilization!r}: give a share in (0, 1], e.g. 0.9")
    if not (isinstance(s.prefix_hit_rate, (int, float)) and 0 <= s.prefix_hit_rate < 1):
        raise ConfigError(f"plan.prefix_hit_rate={s.prefix_hit_rate!r}: give a share in [0, 1), e.g. 0.5")
    if s.weight_dtype not in ELEMENT:
        raise ConfigError(f"plan.weight_dtype={s.weight_dtype!r} is not one of {list(ELEMENT)}")
    if s.kv_dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"plan.kv_dtype={s.kv_dtype!r} is not one of bfloat16, float16, float32")
    if not isinstance(s.budgets, list) or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < 1 for b in s.budgets
    ):
        raise ConfigError(f"plan.budgets={s.budgets!r}: give a list of shares in (0, 1), e.g. [0.5,0.25]")
    if s.link not in LINKS:
        raise ConfigError(f"plan.link={s.link!r} is not one of {list(LINKS)} (or give plan.link_gbps=GB/s)")
    if s.link_gbps is not None:
        positive("link_gbps")
    if s.weights_gib is not None:
        positive("weights_gib")
    if not isinstance(s.runs, list):
        raise ConfigError(f"plan.runs={s.runs!r}: give a list of run folders, e.g. plan.runs=[results/a,results/b]")
    if s.p95_context < s.context:
        raise ConfigError(
            f"plan.p95_context={s.p95_context} is below plan.context={s.context} (the median): the 95th percentile of "
            f"context lengths is at least the median; give e.g. plan.p95_context={2 * s.context}"
        )
    return s


def weights(arch: Arch, source: Source, s: Settings) -> dict[str, Any]:
    """The weight bytes served: plan.weights_gib, else the parameter count (file metadata where present, else the
    config) at plan.weight_dtype; and the parameters a token activates (MoE)."""
    total, active = count_params(arch)
    if s.weights_gib is not None:
        return {"bytes": s.weights_gib * GiB, "source": "plan.weights_gib", "params": None, "active_params": None}
    params, where = source.params or (total, "computed from the config")
    return {
        "bytes": params * element_bytes(s.weight_dtype),
        "source": f"{where}, at {s.weight_dtype}",
        "params": params,
        "params_from_config": total,
        "active_params": active if active != total else None,
    }


def capacity_rows(arch: Arch, s: Settings, free: float, measured: list[dict]) -> list[dict[str, Any]]:
    """The capacity table at plan.context, in the decision guide's order, each option alone and composed with the
    lossless ones above it: paged KV, the sliding window, prefix caching, FP8 KV; int4 instead of FP8; eviction on top
    of them. Rows from run folders use their variants' measured KV ratio."""
    ctx, e = s.context, format_bytes(arch, "bf16", s.kv_dtype)
    full = kv_bytes_per_sequence(arch, ctx, e, window=False)
    rows: list[dict[str, Any]] = []

    def row(option: str, alone: float, composed: float, shared_alone: float = 0.0, shared: float = 0.0, **extra):
        rows.append(
            {
                "option": option,
                "kv_bytes_per_sequence": alone,
                "sequences": sequences(free, alone, shared_alone),
                "composed_kv_bytes_per_sequence": composed,
                "composed_sequences": sequences(free, composed, shared),
                **extra,
            }
        )

    reserve = arch.max_context or ctx
    contiguous = kv_bytes_per_sequence(arch, max(reserve, ctx), e, window=False)
    row(f"contiguous, reserved at max context {max(reserve, ctx)}", contiguous, contiguous)
    row(f"full cache {s.kv_dtype} (paged)", full, full)
    window = kv_bytes_per_sequence(arch, ctx, e)
    chain = full
    if arch.window:
        chain = window
        row(f"sliding window {arch.window} on {arch.sliding_layers}/{arch.layers} layers", window, chain)
    h = s.prefix_hit_rate
    if h > 0:
        row(f"prefix caching at {h:.0%} hit rate", full, chain, h, h)
    fp8 = format_bytes(arch, "fp8") / e
    row("FP8 KV (e4m3, fp16 scales)", full * fp8, chain * fp8, 0, h)
    int4 = format_bytes(arch, "int4") / e
    row("int4 KV (KIVI, group 64) instead of FP8", full * int4, chain * int4, 0, h)
    for b in s.budgets:
        alone = kv_bytes_per_sequence(arch, ctx, e, window=False, budget=b)
        composed = kv_bytes_per_sequence(arch, ctx, fp8 * e, window=True, budget=b)
        row(f"eviction at budget {b:g} (not validated)", alone, composed, 0, h, status="not validated")
    for m in measured:
        r = m["kv_ratio"]
        row(
            f"{m['variant']} (measured {r:.3f}x on {m['model']})",
            full * r,
            chain * r,
            0,
            h,
            status=m["status"],
            why=m["why"],
            run=m["run"],
        )
    base = rows[1]["sequences"]
    for r in rows:
        r["gain"] = r["sequences"] / base if base else None
    return rows


def guide(arch: Arch, s: Settings, w: float, free: float, points: dict, rows: list[dict], measured: list) -> list:
    """The decision guide as one ordered recommendation, each step with the number that triggered it."""
    steps = []
    p95 = points["p95"]
    full_fit = sequences(free, kv_bytes_per_sequence(arch, p95["context"], format_bytes(arch, "bf16", s.kv_dtype)))
    if free <= 0:
        return [
            {
                "step": "quantize weights first",
                "because": f"the weights ({w / GiB:.1f} GiB) leave no room in {s.gpu_gib} GiB x {s.utilization}",
            }
        ]
    if p95["ratio"] < 1 and full_fit >= s.batch:
        return [
            {
                "step": "stop: KV is not the bottleneck",
                "because": f"at p95 (batch {s.batch}, {p95['context']} tokens) KV is {p95['ratio']:.2f}x the weights "
                f"per decode step, and {full_fit} sequences of the full cache fit (>= batch {s.batch})",
            }
        ]
    if p95["ratio"] < 1:
        steps.append(
            {
                "step": "quantize weights first",
                "because": f"weights ({w / GiB:.1f} GiB) exceed the KV read per step at p95 "
                f"({p95['kv_bytes'] / GiB:.1f} GiB, {p95['ratio']:.2f}x): they dominate memory and bandwidth",
            }
        )
    else:
        steps.append(
            {
                "step": "KV is the bottleneck",
                "because": f"at p95 (batch {s.batch}, {p95['context']} tokens) KV is {p95['ratio']:.2f}x the weights "
                f"per decode step; {full_fit} sequences of the cache as declared fit there",
            }
        )
    by = {r["option"].split(" ")[0]: r for r in rows}
    contiguous, paged = rows[0], rows[1]
    steps.append(
        {
            "step": "paged KV",
            "because": f"{contiguous['sequences']} -> {paged['sequences']} sequences at {s.context} tokens "
            "(allocate what a sequence holds, not its max context)",
        }
    )
    done = paged["sequences"] >= s.batch
    for key, name in (("sliding", "sliding window"), ("prefix", "prefix caching"), ("FP8", "FP8 KV")):
        if done or key not in by:
            continue
        r = by[key]
        steps.append(
            {
                "step": name,
                "because": f"{r['composed_sequences']} sequences composed with the steps above ({r['gain']:.2f}x "
                "alone)",
            }
        )
        done = r["composed_sequences"] >= s.batch
    if done:
        steps.append({"step": "stop: no eviction needed", "because": f"batch {s.batch} fits after the steps above"})
        return steps
    passed = [m for m in measured if m["status"] == "PASS"]
    if passed:
        best = max(passed, key=lambda m: 1 / m["kv_ratio"])
        steps.append(
            {
                "step": f"eviction: {best['variant']} (PASSED the gate)",
                "because": f"still short of batch {s.batch}; it holds {best['kv_ratio']:.3f}x the KV ({best['run']})",
            }
        )
    else:
        steps.append(
            {
                "step": "eviction, only with validation",
                "because": f"still short of batch {s.batch} after FP8 KV; validate a policy first: python -m evalkit "
                "gate=default variants=[snapkv@0.25] (no variant given here has PASSED)",
            }
        )
    return steps


def make_plan(model: DictConfig, s: Settings) -> dict[str, Any]:
    source = read_source(model)
    arch = arch_from_config(source.raw, model_label(model))
    if arch.max_context and s.p95_context > arch.max_context:
        s.p95_context = int(arch.max_context)
    w = weights(arch, source, s)
    free = free_bytes(s.gpu_gib, w["bytes"], s.utilization)
    e = format_bytes(arch, "bf16", s.kv_dtype)
    points = {
        "p50": pressure(arch, w["bytes"], s.batch, s.context, e),
        "p95": pressure(arch, w["bytes"], s.batch, s.p95_context, e),
    }
    contexts = sorted({2**k for k in range(10, 21) if 2**k <= max(arch.max_context or 0, s.p95_context)})
    grid = [
        {"batch": b, "context": c, "ratio": pressure(arch, w["bytes"], b, c, e)["ratio"]}
        for b in BATCHES
        for c in contexts
    ]
    measured = measured_variants([Path(r) for r in s.runs])
    rows = capacity_rows(arch, s, free, measured)
    link = s.link_gbps or LINKS[s.link]
    off = offload(points["p95"]["kv_bytes"], w["bytes"], s.hbm_gbps, link)
    off["link"] = "plan.link_gbps" if s.link_gbps else s.link
    return {
        "model": arch.name,
        "config_source": source.where,
        "settings": s.__dict__,
        "architecture": {
            "layers": arch.layers,
            "heads": arch.heads,
            "kv_heads": arch.kv_heads,
            "head_dim": arch.head_dim,
            "attention": "MLA"
            if arch.mla
            else "MHA"
            if arch.kv_heads == arch.heads
            else "MQA"
            if arch.kv_heads == 1
            else f"GQA-{arch.kv_heads}",
            "mla": list(arch.mla) if arch.mla else None,
            "sliding_window": arch.window,
            "sliding_layers": arch.sliding_layers,
            "max_context": arch.max_context,
        },
        "kv_bytes_per_token": {
            fmt: arch.layers * arch.per_layer_elements * format_bytes(arch, fmt, s.kv_dtype)
            for fmt in ("bf16", "fp8", "int4")
        },
        "kv_bytes_per_sequence": {
            "context": s.context,
            "full": kv_bytes_per_sequence(arch, s.context, e, window=False),
            "as_declared": kv_bytes_per_sequence(arch, s.context, e),
        },
        "weights": w,
        "free_bytes": free,
        "pressure": {
            "points": points,
            "grid": grid,
            "crossover": {b: crossover_context(arch, w["bytes"], b, e) for b in BATCHES},
        },
        "capacity": rows,
        "offload": off,
        "guide": guide(arch, s, w["bytes"], free, points, rows, measured),
    }


# --- output ----------------------------------------------------------------------------------------------------------


def _read_verdict(path: Path) -> dict | None:
    """A folder's verdict.json, for its thresholds only (the verdict itself is judged again): None where there is
    none or it holds no thresholds."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot be read ({err}); delete it, or judge the run again") from None
    return doc if isinstance(doc, dict) and isinstance(doc.get("thresholds"), dict) else None


def failed_cells(verdict: dict, name: str) -> list[str]:
    """The cells of `name` that the gate showed to fail, from a verdict.json ("no failure shown" and "not judged:
    ..., a failure here can be shown from N" are not failures)."""
    from evalkit.decide import SHOWN_TO_FAIL  # here: the gate's statistics load only when runs are given

    return [c["cell"] for c in verdict.get("cells", []) if c["variant"] == name and c["status"] == SHOWN_TO_FAIL]


def _b(n: float | None) -> str:
    return fmt_bytes(n)  # evalkit.units: the one formatter of byte quantities


def tables(p: dict[str, Any]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The plan's tables as (header, rows) of strings: the console and plan.md print the same."""
    s, a = p["settings"], p["architecture"]
    kv = p["kv_bytes_per_token"]
    facts = [
        ["model", f"{p['model']} ({p['config_source']})"],
        [
            "attention",
            f"{a['attention']}: {a['layers']} layers, {a['heads']} heads, {a['kv_heads']} KV heads, head_dim "
            f"{a['head_dim']}"
            + (
                f", sliding window {a['sliding_window']} on {a['sliding_layers']} layers" if a["sliding_window"] else ""
            ),
        ],
        [
            "KV bytes per token",
            f"{_b(kv['bf16'])} {s['kv_dtype']}, {_b(kv['fp8'])} FP8, {_b(kv['int4'])} int4 (scales included)",
        ],
        [
            f"KV per sequence at {s['context']}",
            f"{_b(p['kv_bytes_per_sequence']['as_declared'])}"
            + (
                f" (full attention on every layer: {_b(p['kv_bytes_per_sequence']['full'])})"
                if a["sliding_window"]
                else ""
            ),
        ],
        ["weights", f"{_b(p['weights']['bytes'])} ({p['weights']['source']})"],
        ["free for KV", f"{_b(p['free_bytes'])} of {s['gpu_gib']} GiB x {s['utilization']}"],
    ]
    pressure_rows = [
        [
            name,
            str(pt["batch"]),
            str(pt["context"]),
            _b(pt["kv_bytes"]),
            _b(pt["weights_bytes"]),
            f"{pt['ratio']:.2f}x",
            pt["bound"],
        ]
        for name, pt in p["pressure"]["points"].items()
    ]
    cap = [
        [
            r["option"],
            _b(r["kv_bytes_per_sequence"]),
            str(r["sequences"]),
            "-" if r["gain"] is None else f"{r['gain']:.2f}x",
            str(r["composed_sequences"]),
            " ".join(x for x in (r.get("status", ""), r.get("why", "")) if x),
        ]
        for r in p["capacity"]
    ]
    o = p["offload"]
    offload_rows = [
        [
            f"{o['link']} ({o['link_gbps']:g} GB/s)",
            _b(o["kv_step_bytes"]),
            f"{o['needed_gbps']:.0f} GB/s",
            f"{o['compute_seconds'] * 1e3:.1f} ms",
            f"{o['link_seconds'] * 1e3:.1f} ms",
            f"{o['cold_fraction']:.1%}",
        ]
    ]
    guide_rows = [[str(i), g["step"], g["because"]] for i, g in enumerate(p["guide"], 1)]
    return {
        "Model": (["", ""], facts),
        "KV pressure per decode step": (
            ["point", "batch", "context", "KV", "weights", "KV/weights", ""],
            pressure_rows,
        ),
        f"Capacity at {s['context']} tokens": (
            ["option", "KV per sequence", "sequences", "vs full", "composed", "verdict"],
            cap,
        ),
        "Offload at p95 (KV in CPU memory)": (
            ["link", "KV per step", "rate to stream it", "step (GPU reads)", "on the link", "cold share hidden"],
            offload_rows,
        ),
        "Decision guide": (["#", "do", "because"], guide_rows),
    }


def markdown(p: dict[str, Any]) -> str:
    lines = [f"# evalkit plan: {p['model']}", ""]
    for title, (head, rows) in tables(p).items():
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
        if title.startswith("Offload"):
            lines += ["", f"Verdict: offload is {p['offload']['verdict']}."]
        lines.append("")
    lines += [
        "KV-bound: the batch's KV bytes exceed the weight bytes a decode step reads. Composed: with every lossless",
        "row above (paged, window, prefix caching, FP8); eviction composes with FP8. Measured rows apply the run's KV",
        "ratio (on its model) to this model's full cache, beside the gate's verdict.",
        "",
    ]
    return "\n".join(lines)


def print_console(p: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text: plan.md's tables
        print(markdown(p))
        return
    console = Console(width=max(140, Console().width))
    for title, (head, rows) in tables(p).items():
        t = Table(title=title, title_justify="left", show_header=any(head))
        for h in head:
            t.add_column(h)
        for r in rows:
            t.add_row(*r)
        console.print(t)
    console.print(f"Offload: {p['offload']['verdict']}")


def plot(p: dict[str, Any], path: Path) -> None:
    """The crossover curve: for each batch the context at which KV bytes equal weight bytes per decode step (above it:
    KV-bound), and the named operating points labelled with their ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cross = {int(b): c for b, c in p["pressure"]["crossover"].items() if c is not None}
    if cross:
        xs = sorted(cross)
        ax.plot(xs, [cross[x] for x in xs], "k-", label="KV bytes = weight bytes")
        top = max(max(cross.values()), *(pt["context"] for pt in p["pressure"]["points"].values())) * 4
        ax.fill_between(xs, [cross[x] for x in xs], top, color="tab:red", alpha=0.12, label="KV-bound")
    for name, pt in p["pressure"]["points"].items():
        color = "tab:red" if pt["bound"] == "KV-bound" else "tab:blue"
        ax.plot(pt["batch"], pt["context"], "o", color=color)
        ax.annotate(
            f"{name}: {pt['bound']} ({pt['ratio']:.2f}x)",
            (pt["batch"], pt["context"]),
            xytext=(6, 6),
            textcoords="offset points",
            fontsize=9,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("batch (concurrent sequences)")
    ax.set_ylabel("context (tokens)")
    ax.set_title(f"{p['model']}: KV vs weight bytes per decode step ({_b(p['weights']['bytes'])} weights)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(p: dict[str, Any], out: Path) -> list[Path]:
    from evalkit.records import write_atomic

    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "plan.json", json.dumps(p, indent=2, default=str) + "\n")
        write_atomic(out / "plan.md", markdown(p))
        plan_page.write(p, tables(p), out / "plan.html")
        plot(p, out / "plan_pressure.png")
    except OSError as err:
        raise ConfigError(f"cannot write the plan under {out} ({err.strerror or err}); give plan.out=FOLDER") from None
    return [out / name for name in OUTPUTS]


def log_wandb(cfg: DictConfig, p: dict[str, Any], out: Path) -> Path:
    """One W&B run for the plan: the KV and capacity figures as metrics, the tables, the pressure PNG."""
    import wandb

    from evalkit.wandb_log import mode

    run = wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.get("entity"),
        group=cfg.logger.get("group") or "plan",
        name=f"plan-{p['model']}",
        mode=mode(cfg.logger),
        dir=str(out),
        config=OmegaConf.to_container(cfg, resolve=True),
        reinit="finish_previous",
    )
    metrics = {f"kv_bytes_per_token/{k}": v for k, v in p["kv_bytes_per_token"].items()}
    metrics |= {"weights_bytes": p["weights"]["bytes"], "free_bytes": p["free_bytes"]}
    metrics |= {f"pressure/{k}": v["ratio"] for k, v in p["pressure"]["points"].items()}
    for title, (head, rows) in tables(p).items():
        if title.startswith(("Capacity", "Decision")):
            metrics[title.split(" ")[0].lower()] = wandb.Table(columns=[h or "-" for h in head], data=rows)
    metrics["plots/pressure"] = wandb.Image(str(out / "plan_pressure.png"))
    run.log(metrics)
    local = Path(run.dir).parent
    run.finish()
    return local


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,@+-]", "_", text).strip("._") or "_"


def _check_choices(argv: list[str]) -> None:
    """`model=NAME` and `logger=NAME` name a conf/ file (as evalkit.config.check_choices, without importing torch)."""
    import difflib
    from importlib.resources import files

    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key not in ("model", "logger"):
            continue
        valid = sorted(p.name[:-5] for p in files("evalkit.conf").joinpath(key).iterdir() if p.name.endswith(".yaml"))
        if value not in valid:
            near = difflib.get_close_matches(value, valid, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown {key} {value!r}{hint}; valid names: {', '.join(valid)}")


def compose(argv: list[str]) -> DictConfig:
    """conf/plan.yaml with the command line's overrides, composed as Hydra does; errors as one-line ConfigErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from evalkit.hydra_errors import _composition_error, check_resolved, parse

    flags = [a for a in argv if a.startswith("-")]
    if flags:
        raise ConfigError(f"{flags[0]}: evalkit.plan takes key=value overrides only (see conf/plan.yaml)")
    _check_choices(argv)
    parse(argv)
    with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="plan", overrides=argv)
        except (HydraException, OmegaConfBaseException) as err:
            groups = [a for a in argv if a.split("=", 1)[0] in ("model", "logger")]
            try:
                base = hydra_compose(config_name="plan", overrides=groups)
            except (HydraException, OmegaConfBaseException):
                base = None
            raise _composition_error(err, argv, base) from None
    check_resolved(cfg)
    return cfg


def run(argv: list[str]) -> int:
    cfg = compose(argv)
    s = settings(cfg.plan)
    p = make_plan(cfg.model, s)
    out = Path(s.out) if s.out else Path(str(cfg.results_root)) / "plan" / _safe(p["model"])
    print_console(p)
    for path in write(p, out):
        print(f"evalkit: wrote {path}")
    if cfg.logger.name == "wandb":
        print(f"evalkit: W&B run written to {log_wandb(cfg, p, out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from evalkit.cli import guarded

    return guarded(lambda: run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
