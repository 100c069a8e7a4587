"""The run spec: a composed config built once into frozen values and the objects they name (the model, the task, the
variants, another engine, the gate's thresholds), every check that needs no model made on the way. Everything below
the command line reads the spec, never the config.

The pre-check builds each job's spec before Hydra runs; the job that runs the same config in the same process takes
that spec (`take`) instead of building it again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from evalkit import contract, sigint
from evalkit.backends import Backend, BackendSpec
from evalkit.cli import search
from evalkit.cli.config import backend, build, check_settings, listed_variants, validate, variants
from evalkit.config.gatefile import resolved
from evalkit.gate.thresholds import Thresholds, thresholds
from evalkit.kv.variant import Variant
from evalkit.modelspec import ModelSpec
from evalkit.tasks import Task
from evalkit.tracking import check_online


@dataclass(frozen=True)
class GateSpec:
    """gate=NAME: its thresholds, typed and ranged, and its config as plain values (what W&B records)."""

    name: str
    thresholds: Thresholds
    values: dict[str, Any]


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

    config: dict[str, Any]  # the whole config resolved, as run.json records it
    model: ModelSpec
    task: Task
    variants: tuple[Variant, ...]  # evalkit's own engine's; empty with another engine (its own variants)
    backend: BackendSpec | None  # another engine's view of the run (backend=llamacpp, openai); None: evalkit's own
    engine: Backend | None
    gate: GateSpec | None  # None: gate=none
    logger: LoggerSpec
    prefill: PrefillSpec
    seed: int
    protocol: str
    resume: bool
    device: str
    reserve_tokens: int
    results_root: str
    out_dir: Path | None = None  # the run folder, known once Hydra runs the job


def model_spec(node: DictConfig) -> ModelSpec:
    """conf/model/NAME.yaml (the `model` node of a config) as a ModelSpec."""
    return ModelSpec.from_mapping(OmegaConf.to_container(node, resolve=True))


def gate_spec(node: DictConfig) -> GateSpec | None:
    """The gate a config asks for, its thresholds checked; None for gate=none."""
    if node.get("name", "none") == "none":
        return None
    where = repr(node.name)
    values = resolved(node, where)
    return GateSpec(str(node.name), thresholds(values, where), values)


def logger_spec(node: DictConfig | None) -> LoggerSpec:
    """logger=NAME; for wandb, its mode checked and, online, its credentials, before any sample runs."""
    if node is None:
        return LoggerSpec()
    spec = LoggerSpec(
        str(node.get("name", "none")),
        node.get("project"),
        node.get("group"),
        node.get("entity"),
        node.get("mode") or "auto",
    )
    if spec.name == "wandb":
        check_online(spec.mode)
    return spec


def run_spec(cfg: DictConfig) -> RunSpec:
    """The job a composed config asks for, built and checked: every check that needs no model, in the order a user
    meets them (the task, another engine, the variants, the settings, the gate, what the task and model allow)."""
    search.check(cfg)
    task: Task = build(cfg.task, "task")
    model = model_spec(cfg.model)
    listed = listed_variants(cfg)
    node = cfg.get("backend")
    other = None
    if node is not None and node.get("name", "hf") != "hf":
        quant = str((cfg.get("quant") or {}).get("name", "none"))
        other = BackendSpec(model, listed, quant, cfg.get("seed", 0))  # checked below (check_settings)
    engine = backend(node, other, task) if other is not None else None
    chosen = tuple(variants(cfg, search.variants(cfg) if search.budgets(cfg) else None)) if engine is None else ()
    policies = [v.policy for v in chosen]
    with contract.guarding(policies, sigint.received):  # a user's policy raising anywhere is its fault: exit 2
        check_settings(cfg)
        gate = gate_spec(cfg.gate)
        validate(cfg, model, task, policies)
    prefill = cfg.get("prefill") or {}
    return RunSpec(
        config=OmegaConf.to_container(cfg, resolve=True),
        model=model,
        task=task,
        variants=chosen,
        backend=other,
        engine=engine,
        gate=gate,
        logger=logger_spec(cfg.get("logger")),
        prefill=PrefillSpec(
            str(prefill.get("name", "oneshot")), prefill.get("chunk"), bool(prefill.get("compare_oneshot", False))
        ),
        seed=int(cfg.get("seed", 0)),
        protocol=str(cfg.protocol),
        resume=bool(cfg.get("resume", False)),
        device=str(cfg.get("device", "auto")),
        reserve_tokens=int(cfg.get("reserve_tokens", 256)),
        results_root=str(cfg.get("results_root", "results")),
    )


# Specs the pre-check built, for the jobs of this process to take instead of building them again.
_built: list[RunSpec] = []


def keep(spec: RunSpec) -> None:
    _built.append(spec)


def forget() -> None:
    _built.clear()


def take(cfg: DictConfig) -> RunSpec:
    """The spec of this config: the one the pre-check built for the same resolved config, else built now."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for i, spec in enumerate(_built):
        if spec.config == config:
            return _built.pop(i)
    return run_spec(cfg)
