"""A composed config built into the run spec (evalkit.runspec: frozen values, with the folder it writes into) and the
objects it names (the task, the variants, another engine, the gate's thresholds), every check that needs no model
made on the way. Everything below the command line reads the spec and those objects, never the config.

The pre-check builds and checks each job's parts before Hydra runs (`check`) and hands them to the job, which builds
only its run spec with its folder: each object is built once per command. A job the pre-check did not build (a
sweep's job beyond those it checks, or one in a worker process) builds and checks its own."""

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
from evalkit.config.overrides import parse
from evalkit.kv.variant import Variant
from evalkit.modelspec import ModelSpec
from evalkit.runspec import LoggerSpec, PrefillSpec, RunSpec
from evalkit.tasks import Task
from evalkit.thresholds import Thresholds, thresholds
from evalkit.tracking import check_online


@dataclass(frozen=True)
class GateSpec:
    """gate=NAME: its thresholds, typed and ranged, and its config as plain values (what W&B records)."""

    name: str
    thresholds: Thresholds
    values: dict[str, Any]


@dataclass(frozen=True)
class Parts:
    """The objects a run spec's config names, built and checked: the task, evalkit's variants (empty with another
    engine, which has its own), another engine and its view of the run (None: evalkit's own), the gate (None:
    gate=none)."""

    task: Task
    variants: tuple[Variant, ...]
    backend: BackendSpec | None
    engine: Backend | None
    gate: GateSpec | None


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


def parts(cfg: DictConfig, check: bool = True) -> Parts:
    """The objects a composed config names, built, with every check that needs no model, in the order a user meets
    them (the task, another engine, the variants, the settings, the gate, what the task and model allow). The
    pre-check makes them all (`check`); a job, whose config the pre-check checked, leaves out the task's and the
    policies' validation against the model."""
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
        if check:
            validate(cfg, model, task, list(chosen))
    return Parts(task, chosen, other, engine, gate)


def run_spec(cfg: DictConfig, out_dir: Path) -> RunSpec:
    """The run spec of a composed config, writing into `out_dir`."""
    prefill = cfg.get("prefill") or {}
    node = cfg.get("backend")
    return RunSpec(
        config=OmegaConf.to_container(cfg, resolve=True),
        model=model_spec(cfg.model),
        out_dir=out_dir,
        engine=str(node.get("name", "hf")) if node is not None else "hf",
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


def check(cfg: DictConfig) -> Parts:
    """Everything a job's config can be checked for before a model loads: its parts built (returned, for the job to
    run), its logger reached."""
    built = parts(cfg)
    logger_spec(cfg.get("logger"))
    return built


def job_key(overrides: list[str]) -> tuple[str, ...]:
    """What names a job among a command's: its overrides, less Hydra's own (its folder, its launcher), written as
    Hydra's sweeper writes a job's (`key=value`, the value as Hydra prints it), sorted."""
    mine = [o for o in parse(overrides) if not o.get_key_element().lstrip("+~").startswith(("hydra.", "hydra/"))]
    return tuple(sorted(f"{o.get_key_element()}={o.get_value_element_as_str()}" for o in mine))
