"""Model and tokenizer loading: embedded GGUF models (converted once, cached as safetensors), any Hugging Face
id or local path, and tiny random models built from a config for tests.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from platformdirs import user_cache_dir
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from evalkit import attention
from evalkit.errors import ConfigError


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str  # identifies the weights: the GGUF's sha256, the hub revision, or the random seed
    load_seconds: float
    source: str  # where the weights came from, in words


def cache_root() -> Path:
    """Where converted models are cached; EVALKIT_CACHE overrides the user cache directory."""
    return Path(os.environ.get("EVALKIT_CACHE") or user_cache_dir("evalkit")) / "models"


def max_context(cfg: DictConfig) -> int:
    """The model's maximum context in tokens, known without loading its weights."""
    if cfg.get("max_context"):
        return int(cfg.max_context)
    if cfg.kind == "hf":
        return int(AutoConfig.from_pretrained(cfg.name_or_path).max_position_embeddings)
    raise ConfigError(f"model {cfg.name}: set model.max_context")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


ATTENTION = ("sdpa", "flash_attention_2")


def check_attention(cfg: DictConfig) -> None:
    """ConfigError for an attention implementation evalkit cannot run, before any weights load."""
    impl = cfg.get("attn_implementation", "sdpa")
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


def load(cfg: DictConfig, device: str = "auto") -> LoadedModel:
    """Load the model described by a `conf/model/*.yaml` config, in eval mode, on `device`; with
    `model.device_map` (hf models: `auto`, `balanced`, ...), accelerate places it across the available GPUs."""
    start = time.perf_counter()
    loaders = {"gguf": _load_gguf, "hf": _load_hf, "tiny-random": _load_tiny_random}
    if cfg.kind not in loaders:
        raise ConfigError(f"model.kind={cfg.kind!r} is not one of {sorted(loaders)}")
    check_attention(cfg)
    model, tokenizer, fingerprint, source = loaders[cfg.kind](cfg)
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(attention.register())  # SDPA that policies can observe
    if not cfg.get("device_map"):
        model.to(pick_device(device))
    model.eval()
    return LoadedModel(cfg.name, model, tokenizer, fingerprint, time.perf_counter() - start, source)


DTYPES = ("float32", "bfloat16", "float16")


def _dtype(cfg: DictConfig) -> torch.dtype:
    name = cfg.get("dtype", "float32")
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name!r} is not one of {list(DTYPES)}")
    return getattr(torch, name)


def _load_hf(cfg: DictConfig):
    kwargs = {"dtype": _dtype(cfg), "attn_implementation": cfg.get("attn_implementation", "sdpa")}
    if cfg.get("revision"):
        kwargs["revision"] = cfg.revision
    if cfg.get("device_map"):
        kwargs["device_map"] = cfg.device_map
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path, revision=cfg.get("revision"))
        model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, **kwargs)
    except OSError as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path!r} could not be loaded ({str(err).splitlines()[0]}); "
            "give a local folder with config.json and weights, or a Hub id on a machine that reaches the Hub"
        ) from err
    fingerprint = getattr(model.config, "_commit_hash", None) or str(cfg.name_or_path)
    return model, tokenizer, fingerprint, str(cfg.name_or_path)


def _load_gguf(cfg: DictConfig):
    cached = cache_root() / f"{cfg.name}-{cfg.package_version}"
    if not (cached / "evalkit.json").exists():
        _convert_gguf(cfg, cached)
    meta = json.loads((cached / "evalkit.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = AutoModelForCausalLM.from_pretrained(
        cached, dtype=_dtype(cfg), attn_implementation=cfg.get("attn_implementation", "sdpa")
    )
    return model, tokenizer, meta["gguf_sha256"], f"{cfg.package}=={cfg.package_version} via {cached}"


def _gguf_path(cfg: DictConfig, workdir: Path) -> Path:
    """Locate (or, for chunked packages, assemble) the GGUF file without importing the package's CLI deps."""
    spec = importlib.util.find_spec(cfg.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {cfg.name} needs the package {cfg.package}; install it with: {cfg.pip_install}")
    if cfg.get("assemble"):
        module = importlib.import_module(cfg.module)
        return Path(module.assemble(workdir / cfg.gguf_file))
    return Path(spec.submodule_search_locations[0]) / cfg.gguf_file


def _convert_gguf(cfg: DictConfig, target: Path) -> None:
    """Dequantize the GGUF once and store it as safetensors; written to a temporary folder, then renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        gguf = _gguf_path(cfg, work)
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
            "gguf_sha256": _sha256(gguf),
            "package": cfg.package,
            "package_version": cfg.package_version,
        }
        (out / "evalkit.json").write_text(json.dumps(meta, indent=2))
        if target.exists():  # a concurrent conversion finished first
            return
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer built in memory (one token per byte), so tiny test models need no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _load_tiny_random(cfg: DictConfig):
    tokenizer = byte_tokenizer()
    config = AutoConfig.for_model(
        cfg.architecture,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=int(cfg.max_context),
        **OmegaConf.to_container(cfg.config),
    )
    config._attn_implementation = cfg.get("attn_implementation", "sdpa")
    torch.manual_seed(int(cfg.seed))
    model = AutoModelForCausalLM.from_config(config, dtype=_dtype(cfg))
    return model, tokenizer, f"tiny-random:{cfg.architecture}:seed={cfg.seed}", "random init from config"
