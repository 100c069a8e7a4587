"""A model as a run or the planner names it (conf/model/*.yaml), frozen: built once by the command line and read by
the engines that load it, the llama.cpp and server backends, the planner and the embedded models' cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from evalkit.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    """conf/model/NAME.yaml as plain values. `kind` says which fields apply: hf (name_or_path, revision, device_map),
    gguf (the embedded package: package, package_version, module, gguf_file, pip_install, assemble), tiny-random
    (architecture, seed, config)."""

    name: str
    kind: str
    max_context: int | None = None  # tokens; None: read from an hf model's config
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    name_or_path: str | None = None
    revision: str | None = None
    device_map: str | None = None
    package: str | None = None
    package_version: str | None = None
    module: str | None = None
    gguf_file: str | None = None
    pip_install: str | None = None
    assemble: bool = False
    architecture: str | None = None
    seed: int = 0
    config: dict[str, Any] = field(default_factory=dict)  # the tiny-random architecture's config keys

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ModelSpec:
        """The spec of a model config given as plain values; keys it does not know are left out, as the loaders
        never read them."""
        missing = [k for k in ("name", "kind") if k not in values]
        if missing:
            raise ConfigError(
                f"model.{missing[0]} is not set: every model config names its name and kind (hf, gguf or "
                "tiny-random), as conf/model/hf.yaml does"
            )
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})
