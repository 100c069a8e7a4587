"""The models evalkit ships or builds without a download, and where it keeps them: a leaf with no torch, shared by
the run pipeline (which loads them), the planner (which reads their configs) and the llama.cpp backend (which runs
their GGUF files)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from platformdirs import user_cache_dir

from evalkit.errors import ConfigError
from evalkit.modelspec import ModelSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def user_cache() -> Path:
    """evalkit's cache folder: EVALKIT_CACHE, or the user cache directory."""
    return Path(os.environ.get("EVALKIT_CACHE") or user_cache_dir("evalkit"))


def cache_root() -> Path:
    """Where converted models are cached."""
    return user_cache() / "models"


def converted_folder(model: ModelSpec) -> Path:
    """The safetensors folder an embedded GGUF model is converted into, once."""
    return cache_root() / f"{model.name}-{model.package_version}"


def gguf_path(model: ModelSpec) -> Path:
    """The GGUF file of an embedded model: in its package, or assembled once from a chunked package's parts (into
    the cache, beside the converted models), without importing the package's command-line dependencies."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {model.name} needs the package {model.package}; install it with: {model.pip_install}")
    if not model.assemble:
        return Path(spec.submodule_search_locations[0]) / model.gguf_file
    target = cache_root().parent / "gguf" / f"{model.name}-{model.package_version}" / model.gguf_file
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.part")
        importlib.import_module(model.module).assemble(partial)
        os.replace(partial, target)
    return target


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


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file (a GGUF, a dataset), read a MiB at a time: what records fingerprint inputs by."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
