"""Model and tokenizer loading: embedded GGUF models (converted once, cached as safetensors), any Hugging Face
id or local path, and tiny random models built from a config for tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from evalkit.attention import sdpa
from evalkit.embedded import byte_tokenizer, converted_folder, file_sha256, gguf_path
from evalkit.errors import ConfigError
from evalkit.modelspec import ModelSpec

T = TypeVar("T")


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str  # identifies the weights: the GGUF's sha256, the hub revision, or the random seed
    load_seconds: float
    source: str  # where the weights came from, in words

    def info(self) -> dict[str, object]:
        """What run.json records of the model: the gate compares runs by its fingerprint."""
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "weights_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "source": self.source,
            "load_seconds": round(self.load_seconds, 3),
        }


def max_context(spec: ModelSpec) -> int:
    """The model's maximum context in tokens, known without loading its weights."""
    if spec.max_context:
        return int(spec.max_context)
    if spec.kind == "hf":
        return int(AutoConfig.from_pretrained(spec.name_or_path).max_position_embeddings)
    raise ConfigError(f"model {spec.name}: set model.max_context")


DEVICES = ("auto", "cpu", "cuda")


def check_device(device: object) -> None:
    """ConfigError, before anything loads, for a device that is not auto, cpu, cuda or cuda:N, or not here."""
    text = str(device)
    kind, colon, index = text.partition(":")
    if kind not in DEVICES or (colon and not (kind == "cuda" and index.isdigit())):
        raise ConfigError(f"device={text!r} is not one of {', '.join(DEVICES)} (or cuda:N); give e.g. device=auto")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={text} but no CUDA GPU is visible here; use device=cpu or auto")
        if colon and int(index) >= torch.cuda.device_count():
            n = torch.cuda.device_count()
            raise ConfigError(f"device={text} but {n} CUDA GPU(s) are visible here; use cuda:0 to cuda:{n - 1}")


def pick_device(device: str) -> torch.device:
    check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_source(spec: ModelSpec) -> None:
    """ConfigError, before anything loads, for an hf model in a local folder that asks to run its own code
    (`auto_map` in config.json or tokenizer_config.json: transformers would need trust_remote_code, which evalkit
    never passes). Hub ids are checked as they load (`_refused`)."""
    if spec.kind != "hf" or not isinstance(spec.name_or_path, str):
        return
    folder = Path(spec.name_or_path).expanduser()
    for name in ("config.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ConfigError(
                f"model.name_or_path={spec.name_or_path!r}: {name} is not readable JSON ({err}); fix or replace it"
            ) from None
        if isinstance(data, dict) and data.get("auto_map"):
            raise _remote_code(spec, f"auto_map in {name}")


def _remote_code(spec: ModelSpec, why: str) -> ConfigError:
    return ConfigError(
        f"model.name_or_path={spec.name_or_path!r} asks to run its own Python code to load ({why}; trust_remote_code),"
        " which evalkit never does; use a model whose architecture transformers implements"
    )


def _refused(spec: ModelSpec, err: Exception) -> ConfigError | None:
    """The one-line ConfigError for a model transformers or torch refuse to load: one that needs its own code run,
    or pickle weights (*.bin) that hold more than tensors and so cannot load with torch's weights_only unpickler.
    None for any other error."""
    if isinstance(err, pickle.UnpicklingError):
        reason = next((ln.strip() for ln in str(err).splitlines() if "Unsupported global" in ln), "").split(" was ")[0]
        return ConfigError(
            f"model.name_or_path={spec.name_or_path!r} holds pickle weights that torch refuses to load safely "
            f"(weights_only{': ' + reason if reason else ''}); use a model with *.safetensors weights (convert these "
            "once, only if you trust their source, with save_pretrained)"
        )
    if isinstance(err, ValueError) and "trust_remote_code" in str(err):
        return _remote_code(spec, "custom code in the repository")
    return None


ATTENTION = ("sdpa", "flash_attention_2")


def check_attention(spec: ModelSpec) -> None:
    """ConfigError for an attention implementation evalkit cannot run, before any weights load."""
    impl = spec.attn_implementation
    if impl not in ATTENTION:
        raise ConfigError(f"model.attn_implementation={impl!r} is not one of {list(ATTENTION)}")
    if impl == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "model.attn_implementation=flash_attention_2 needs the flash-attn package (pip install flash-attn "
                "--no-build-isolation, on a CUDA machine); or use model.attn_implementation=sdpa"
            )
        if not torch.cuda.is_available():
            raise ConfigError("model.attn_implementation=flash_attention_2 runs on CUDA GPUs only; use sdpa here")


def load(spec: ModelSpec, device: str = "auto") -> LoadedModel:
    """Load the model described by a `conf/model/*.yaml` config, in eval mode, on `device`; with
    `model.device_map` (hf models: `auto`, `balanced`, ...), accelerate places it across the available GPUs."""
    start = time.perf_counter()
    loaders = {"gguf": _load_gguf, "hf": _load_hf, "tiny-random": _load_tiny_random}
    if spec.kind not in loaders:
        raise ConfigError(f"model.kind={spec.kind!r} is not one of {sorted(loaders)}")
    check_attention(spec)
    model, tokenizer, fingerprint, source = loaders[spec.kind](spec)
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(sdpa.register())  # SDPA that policies can observe
    if not spec.device_map:
        model.to(pick_device(device))
    model.eval()
    return LoadedModel(spec.name, model, tokenizer, fingerprint, time.perf_counter() - start, source)


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone, without its weights: samples are built and checked before the weights load.
    (An embedded GGUF model is converted first, once, as `load` would.)"""
    if spec.kind == "tiny-random":
        return byte_tokenizer()
    if spec.kind == "gguf":
        cached = converted_folder(spec)
        if not (cached / "evalkit.json").exists():
            _convert_gguf(spec, cached)
        return AutoTokenizer.from_pretrained(cached)
    if spec.kind == "hf":
        return _from_hf(spec, lambda: AutoTokenizer.from_pretrained(spec.name_or_path, revision=spec.revision))
    raise ConfigError(f"model.kind={spec.kind!r} is not one of ['gguf', 'hf', 'tiny-random']")


DTYPES = ("float32", "bfloat16", "float16")


def _dtype(spec: ModelSpec) -> torch.dtype:
    name = spec.dtype
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not one of {list(DTYPES)}")
    return getattr(torch, name)


def _load_hf(spec: ModelSpec):
    kwargs = {"dtype": _dtype(spec), "attn_implementation": spec.attn_implementation}
    if spec.revision:
        kwargs["revision"] = spec.revision
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    tokenizer = load_tokenizer(spec)
    model = _from_hf(spec, lambda: AutoModelForCausalLM.from_pretrained(spec.name_or_path, **kwargs))
    fingerprint = getattr(model.config, "_commit_hash", None) or str(spec.name_or_path)
    return model, tokenizer, fingerprint, str(spec.name_or_path)


def _from_hf(spec: ModelSpec, load: Callable[[], T]) -> T:
    """`load()` (a from_pretrained of model.name_or_path), its refusals and a missing folder as one-line errors."""
    try:
        return load()
    except (ValueError, pickle.UnpicklingError) as err:
        refused = _refused(spec, err)
        if refused is None:
            raise
        raise refused from None
    except OSError as err:
        raise ConfigError(
            f"model.name_or_path={spec.name_or_path!r} could not be loaded ({str(err).splitlines()[0]}); "
            "give a local folder with config.json, tokenizer and weights, or a Hub id on a machine that reaches the Hub"
        ) from err


def _load_gguf(spec: ModelSpec):
    cached = converted_folder(spec)
    if not (cached / "evalkit.json").exists():
        _convert_gguf(spec, cached)
    meta = json.loads((cached / "evalkit.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = AutoModelForCausalLM.from_pretrained(
        cached, dtype=_dtype(spec), attn_implementation=spec.attn_implementation
    )
    return model, tokenizer, meta["gguf_sha256"], f"{spec.package}=={spec.package_version} via {cached}"


def _convert_gguf(spec: ModelSpec, target: Path) -> None:
    """Dequantize the GGUF once and store it as safetensors; written to a temporary folder, then renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        gguf = gguf_path(spec)
        print(f"evalkit: converting {gguf.name} to safetensors (once) into {target}", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized floats now; drop the GGUF quantizer so save_pretrained writes them.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        meta = {
            "gguf_file": gguf.name,
            "gguf_sha256": file_sha256(gguf),
            "package": spec.package,
            "package_version": spec.package_version,
        }
        (out / "evalkit.json").write_text(json.dumps(meta, indent=2))
        if target.exists():  # a concurrent conversion finished first
            return
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load_tiny_random(spec: ModelSpec):
    tokenizer = byte_tokenizer()
    config = AutoConfig.for_model(
        spec.architecture,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=int(spec.max_context),
        **spec.config,
    )
    config._attn_implementation = spec.attn_implementation
    torch.manual_seed(int(spec.seed))
    model = AutoModelForCausalLM.from_config(config, dtype=_dtype(spec))
    return model, tokenizer, f"tiny-random:{spec.architecture}:seed={spec.seed}", "random init from config"
