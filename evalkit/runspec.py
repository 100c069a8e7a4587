"""The run spec: one job of a command line as frozen plain values, built once (evalkit.cli.spec) with the folder it
writes into. It names what the run uses (the model, the engine, the settings) and holds the whole resolved config as
run.json records it; the objects the config names (the task, the policies and variants, another engine) are built
beside it, never held in it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from evalkit.modelspec import ModelSpec


def frozen(value: Any) -> Any:
    """A plain value with its containers made immutable: mappings read-only (MappingProxyType), lists tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: frozen(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


def thawed(value: Any) -> Any:
    """The plain value `frozen` made immutable, as JSON holds it again: dicts and lists."""
    if isinstance(value, Mapping):
        return {k: thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thawed(v) for v in value]
    return value


@dataclass(frozen=True)
class LoggerSpec:
    """logger=NAME: none, or wandb with where its runs go."""

    name: str = "none"
    project: str | None = None
    group: str | None = None
    entity: str | None = None
    mode: str = "auto"


@dataclass(frozen=True)
class PrefillSpec:
    """prefill=NAME: oneshot, or chunked in `chunk` tokens (and each variant one-shot too with compare_oneshot)."""

    name: str = "oneshot"
    chunk: int | None = None
    compare_oneshot: bool = False


@dataclass(frozen=True)
class RunSpec:
    """One job of the command line, built and checked: what the run reads, and nothing of Hydra's."""

    config: Mapping[str, Any]  # the whole config resolved (frozen: read-only mappings, tuples)
    model: ModelSpec
    out_dir: Path  # the run folder
    engine: str  # which engine answers: "hf" (evalkit's own) or another's name (backend=llamacpp, openai)
    logger: LoggerSpec
    prefill: PrefillSpec
    seed: int
    protocol: str
    resume: bool
    device: str
    reserve_tokens: int
    results_root: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", frozen(self.config))

    def plain_config(self) -> dict[str, Any]:
        """The config as run.json records it: plain dicts and lists."""
        return thawed(self.config)
