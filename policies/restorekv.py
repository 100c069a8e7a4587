"""RestoreKV: KVzip's eviction plus a few learned restore tokens that stand in for what was evicted.

RestoreKV (arXiv:2608.01247), as kvpress's RestoreKVPress runs it: after the context is prefilled and KVzip has scored
it (policies/kvzip.py), n restore tokens (learned input embeddings, 8 in the published adapters) are read in one pass
over the full cache, with a LoRA adapter active for that pass alone; their keys and values are appended to the cache at
the positions after the context (T .. T + n - 1), and the question follows them (from T + n). The budget is matched:
the restore tokens take n of each KV head's slots, so KVzip keeps (k - n) x KV heads x layers context tokens, ranked
as KVzip ranks them (kvpress raises its compression ratio by n / T). Only the embeddings and the adapter are
trained, by self-distillation from the full cache. A budget that keeps every token adds none (kvpress runs no
compression at ratio 0): the identity holds.

evalkit never reaches the Hub at run time: `policy.weights_path` names a folder in the published layout, as PEFT
saves an adapter beside the embeddings (restore_embeddings.safetensors holding `restore_embeddings` (n, hidden);
adapter_config.json; adapter_model.safetensors). On a connected machine:

    huggingface-cli download higokri/RestoreKV-<model>[_plus] --local-dir restorekv

(adapters are published for Llama-3.1-8B-Instruct and Qwen3-8B), or train a stand-in here
(`python -m evalkit.calibrate restorekv`). The adapter is applied as PEFT applies a LoRA layer at inference, out = W x +
(B A x) x alpha / r (alpha / sqrt(r) with rsLoRA), through forward hooks on the named linear layers for the one pass.
The folder's path and the SHA-256 of its three files are recorded in run.json. Models with sliding-window layers are
refused: the restore tokens would have to enter those layers too, which hold only their window.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor
from transformers.cache_utils import Cache

from evalkit.attention.observation import Observation
from evalkit.errors import ConfigError, ParamError
from evalkit.policies import LayerView, full_attention_only
from evalkit.policies.kvzip import KVzip
from evalkit.policies.kvzip_pass import ReadOnlyLayer
from evalkit.policies.weights import check_shape

FETCH = "huggingface-cli download higokri/RestoreKV-<model> --local-dir DIR, or python -m evalkit.calibrate restorekv"
EMBEDDINGS = "restore_embeddings.safetensors"
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")
PREFIX = "base_model.model."  # PEFT's prefix of a saved adapter's tensor names


@dataclass
class Lora:
    """One linear layer's adapter: A (r, in), B (out, r) and the scaling that multiplies B A x."""

    a: Tensor
    b: Tensor
    scaling: float


@dataclass
class Restore:
    """A RestoreKV folder, read: the restore embeddings (n, hidden) and the adapter per linear layer (by its module
    path in the model, e.g. model.layers.0.self_attn.q_proj)."""

    embeddings: Tensor
    lora: dict[str, Lora]
    recorded: dict[str, str]


def bad(path: str, why: str) -> ConfigError:
    return ParamError({"weights_path": path}, f": {why}; {FETCH}")


def read_embeddings(path: str) -> Tensor:
    """The restore embeddings (n, hidden) of the folder `path`."""
    folder = Path(path).expanduser()
    try:
        got = load_file(str(folder / EMBEDDINGS))["restore_embeddings"]
    except (SafetensorError, KeyError, OSError) as err:
        raise bad(path, f"no restore embeddings in {EMBEDDINGS} ({err})") from None
    if got.dim() != 2 or got.shape[0] < 1:
        raise bad(path, f"restore_embeddings of shape {tuple(got.shape)}, not (tokens, hidden)")
    return got


def read_adapter(path: str) -> dict[str, Lora]:
    """The LoRA adapter of the folder `path` as PEFT saves one: per module path, its A, B and scaling."""
    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / ADAPTER[0]).read_text())
        tensors = load_file(str(folder / ADAPTER[1]))
    except (SafetensorError, OSError, ValueError) as err:
        raise bad(path, f"no LoRA adapter in {' and '.join(ADAPTER)} ({err})") from None
    if not isinstance(config, dict) or not isinstance(config.get("lora_alpha"), int | float):
        raise bad(path, f"{ADAPTER[0]} is not a LoRA adapter's configuration (no lora_alpha)")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if any(unsupported.values()):
        named = ", ".join(k for k, v in unsupported.items() if v)
        raise bad(path, f"the adapter sets {named}, which evalkit does not apply (a plain LoRA on linear layers)")
    lora = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        if b is None or a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise bad(path, f"{module}: lora_A {tuple(a.shape)} without a matching lora_B")
        r = a.shape[0]
        scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        lora[module] = Lora(a.float(), b.float(), float(scaling))
    if not lora:
        raise bad(path, f"{ADAPTER[1]} holds no lora_A/lora_B pairs")
    return lora


def read_restore(path: str, model: torch.nn.Module) -> Restore:
    """The folder `path` read and checked against `model` (hidden size, every adapted layer's shape)."""
    embeddings = read_embeddings(path)
    hidden = model.config.get_text_config().hidden_size
    check_shape(path, "restore_embeddings", embeddings.shape[1:], (hidden,), "hidden size", FETCH)
    lora = read_adapter(path)
    for name, pair in lora.items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise bad(path, f"the adapter names {name}, which this model does not have: another model's") from None
        want = (pair.a.shape[0], linear.out_features, linear.in_features)
        check_shape(path, name, (pair.b.shape[1], pair.b.shape[0], pair.a.shape[1]), want, "rank, out, in", FETCH)
    folder = Path(path).expanduser().resolve()
    digest = hashlib.sha256()
    for name in (EMBEDDINGS, *ADAPTER):
        digest.update((folder / name).read_bytes())
    return Restore(embeddings, lora, {"weights_path": str(folder), "sha256": digest.hexdigest()})


@contextmanager
def adapted(model: torch.nn.Module, lora: dict[str, Lora]) -> Iterator[None]:
    """Within the block, every adapted linear layer of `model` returns W x + (B A x) x scaling, as PEFT's LoRA layer
    computes at inference (forward hooks, removed on the way out)."""

    def hook(pair: Lora):
        def add(module, args, out: Tensor) -> Tensor:
            x = args[0]
            return out + (x.to(pair.a.dtype) @ pair.a.T @ pair.b.T).to(out.dtype) * pair.scaling

        return add

    handles = [model.get_submodule(name).register_forward_hook(hook(pair)) for name, pair in lora.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class Recording(ReadOnlyLayer):
    """A full cache layer read in place by the restore pass, which keeps the keys and values the pass computes."""

    added: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.added = (key_states, value_states)
        return super().update(key_states, value_states, *args, **kwargs)


def read_pass(
    model: torch.nn.Module, full: Cache, embeddings: Tensor, lora: dict[str, Lora]
) -> dict[int, tuple[Tensor, Tensor]]:
    """Per layer, the keys and values (B, Hkv, n, D) of the n restore tokens `embeddings` (n, hidden) read over the
    full cache `full` (left unchanged) at the positions after it, the adapter `lora` active for this pass alone
    (gradients flow where the caller allows them: `python -m evalkit.calibrate restorekv`)."""
    layers = [Recording(layer.keys, layer.values) for layer in full.layers]
    t, n = full.get_seq_length(), embeddings.shape[0]
    device, dtype = full.layers[0].keys.device, full.layers[0].keys.dtype
    positions = torch.arange(t, t + n, device=device)[None]
    with adapted(model, lora):
        inputs = embeddings.to(device=device, dtype=dtype)[None]
        cache = Cache(layers=layers)
        model(inputs_embeds=inputs, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return {i: layer.added for i, layer in enumerate(layers)}


@dataclass(frozen=True)
class RestorePass(Observation):
    """Per layer, the restore tokens' (keys, values), each (B, Hkv, n, D), from the folder `path`."""

    path: str
    restore: Restore | None = field(default=None, compare=False, hash=False, repr=False)
    pass_name: ClassVar[str] = "restore"

    def second_pass(self, model: torch.nn.Module, full: Cache, context: Tensor, prompt) -> dict[int, object]:
        if self.restore is None:
            raise ValueError("restorekv: the restore weights were not read (prepare() was not called)")
        with torch.inference_mode():
            return read_pass(model, full, self.restore.embeddings, self.restore.lora)


@dataclass(kw_only=True)
class RestoreKV(KVzip):
    """KVzip at k - n tokens per KV head on average, plus the n restore tokens of `weights_path` in every head."""

    name: str = "restorekv"
    weights_path: str | None = None
    adds_tokens: ClassVar[bool] = True  # its restore tokens, after the context (added)

    def restore_tokens(self) -> int:
        """n: how many restore tokens the folder holds (read once)."""
        if not hasattr(self, "n_restore"):
            self.n_restore = read_embeddings(self.weights_path).shape[0]  # not a field
        return self.n_restore

    def needs(self) -> tuple[Observation, ...]:
        return (*super().needs(), RestorePass(self.weights_path, getattr(self, "restore", None)))

    def prepare(self, model, probes) -> dict:
        full_attention_only(model, self.name, "use kvzip, whose cache holds no added tokens")
        self.restore = read_restore(self.weights_path, model)  # not a field
        return self.restore.recorded

    def min_tokens(self) -> int:
        return super().min_tokens() + self.restore_tokens()

    def restored(self, k: int, seen: int) -> int:
        """Restore tokens per KV head at a target of k tokens of `seen`: n, or none where k keeps every token."""
        return self.restore_tokens() if k < seen else 0

    def over(self, view: LayerView, k: int) -> bool:
        return super().over(view, k - self.restored(k, view.seen))

    def total(self, slots: int, targets: list[tuple[int, int]]) -> int:
        """KVzip's count of context tokens at each head's k less the n restore tokens it also holds (`slots`: every
        head's tokens seen, so slots / heads of them per head)."""
        seen = slots // sum(heads for _, heads in targets)
        return super().total(slots, [(k - self.restored(k, seen), heads) for k, heads in targets])

    def added(self, view: LayerView) -> tuple[Tensor, Tensor] | None:
        """The restore tokens, unless the budget keeps every token (then nothing is evicted and nothing added)."""
        if not self.restored(self.target(view.seen), view.seen):
            return None
        return view.observed(self.needs()[1])

    def check_params(self) -> None:
        super().check_params()
        if self.weights_path is None:
            raise ParamError(
                {"weights_path": None},
                f"restorekv needs its restore tokens and adapter: give $weights_path=DIR ({FETCH})",
                unset=True,
            )
        self.restore_tokens()
