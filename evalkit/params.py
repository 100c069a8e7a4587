"""A model's parameter count: from safetensors metadata where the files are there, else counted from its config
(dense, MoE, MLA)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from evalkit.arch import Arch


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
