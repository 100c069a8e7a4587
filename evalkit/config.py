"""Config checks that run before any model is loaded: unknown names, impossible budgets and grids."""

from __future__ import annotations

import dataclasses
import difflib
from importlib.resources import files

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from evalkit import models
from evalkit.engine import Variant
from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy
from evalkit.prompt import PROTOCOLS
from evalkit.quantized import QuantSpec
from evalkit.tasks import Task

GROUPS = ("model", "policy", "quant", "prefill", "task", "gate", "logger")


def options(group: str) -> list[str]:
    """The names a config group accepts: its YAML files in evalkit's conf/."""
    return sorted(p.name[:-5] for p in files("evalkit.conf").joinpath(group).iterdir() if p.name.endswith(".yaml"))


def check_choices(overrides: list[str]) -> None:
    """Reject `group=name` overrides that name no config, listing the valid names (and the nearest one)."""
    for arg in overrides:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep or key not in GROUPS or value.startswith(("glob(", "choice(", "range(")):
            continue
        valid = options(key)
        for name in value.split(","):
            if name not in valid:
                near = difflib.get_close_matches(name, valid, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise ConfigError(f"unknown {key} {name!r}{hint}; valid names: {', '.join(valid)}")


def quant_spec(node: DictConfig) -> QuantSpec | None:
    """The storage a conf/quant config asks for; None for full precision."""
    if node.get("bits") is None:
        return None
    if node.get("format") == "e4m3":
        spec = QuantSpec(name=node.name, bits=8, format="e4m3")
        spec.validate()
        return spec
    spec = QuantSpec(name=node.name, bits=int(node.bits), group=int(node.group), residual=int(node.residual))
    spec.validate()
    return spec


def _named(group: str, name: str, spec: str) -> DictConfig:
    valid = options(group)
    if name not in valid:
        near = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"variants: unknown {group} {name!r} in {spec!r}{hint}; valid names: {', '.join(valid)}")
    return OmegaConf.load(files("evalkit.conf") / group / f"{name}.yaml")


def variants(cfg: DictConfig) -> list[Variant]:
    """The variants a run evaluates: `variants=[snapkv@0.25,h2o@0.5+int4,h2o@1024:chunk512]` when given, else
    `policy` + `quant`.

    Each is its policy's YAML with the budget after '@' (a fraction like 0.25 or a token count like 512), after
    '+' a conf/quant storage, and after ':chunk' the chunk size of a chunked prefill. `prefill=chunked` prefills
    every variant in chunks of `prefill.chunk` tokens and, with `prefill.compare_oneshot`, also runs each one-shot,
    on the same samples, for the side-by-side comparison.
    """
    if not cfg.get("variants"):
        out = [Variant(instantiate(cfg.policy, _convert_="all"), quant_spec(cfg.quant))]
    else:
        out = [_parse_variant(cfg, str(spec)) for spec in cfg.variants]
    prefill = cfg.get("prefill") or {}
    if prefill.get("name", "oneshot") not in ("oneshot", "chunked"):
        raise ConfigError(f"prefill={prefill.get('name')!r} is not one of ['chunked', 'oneshot']")
    if prefill.get("name") == "chunked":
        chunked = [dataclasses.replace(v, chunk=prefill.get("chunk") if v.chunk is None else v.chunk) for v in out]
        out = ([v for v in out if v.chunk is None] if prefill.get("compare_oneshot") else []) + chunked
    for v in out:
        v.validate()
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"variants: {sorted({n for n in names if names.count(n) > 1})} are listed more than once")
    return out


def _parse_variant(cfg: DictConfig, spec: str) -> Variant:
    """`NAME@BUDGET[+QUANT][:chunkN]` -> Variant."""
    head, _, chunk = spec.partition(":")
    head, _, quant = head.partition("+")
    name, sep, budget = head.partition("@")
    node = OmegaConf.create({"seed": cfg.seed, "policy": _named("policy", name, spec)})
    if sep:
        try:
            node.policy.budget = int(budget) if budget.isdigit() else float(budget)
        except ValueError:
            raise ConfigError(f"variants: {spec!r} needs NAME@BUDGET with a number, e.g. snapkv@0.25") from None
    if chunk and not (chunk.startswith("chunk") and chunk[5:].isdigit()):
        raise ConfigError(f"variants: {spec!r}: write a chunked prefill as ':chunkN', e.g. h2o@1024:chunk512")
    return Variant(
        instantiate(node.policy, _convert_="all"),
        quant_spec(_named("quant", quant, spec)) if quant else None,
        int(chunk[5:]) if chunk else None,
    )


def validate(cfg: DictConfig, task: Task, policies: list[KVPolicy]) -> None:
    """Everything that can be known wrong before the model loads."""
    if cfg.protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={cfg.protocol!r} is not one of {list(PROTOCOLS)}")
    task.validate()
    if task.teacher_forced and cfg.protocol != "query_agnostic":
        raise ConfigError(
            f"task={task.name} teacher-forces a continuation that is never compressed: use protocol=query_agnostic"
        )
    if not task.lengths():  # lengths known only per sample (JSONL): checked as each sample is tokenized
        for policy in policies:
            policy.validate(None)
        return
    limit = models.max_context(cfg.model) - int(cfg.reserve_tokens)
    too_long = [n for n in task.lengths() if n > limit]
    if too_long:
        raise ConfigError(
            f"context lengths {too_long} exceed what {cfg.model.name} can take: {models.max_context(cfg.model)} "
            f"tokens less {cfg.reserve_tokens} reserved for the question and answer = {limit}; use shorter lengths"
        )
    for policy in policies:
        policy.validate(min(task.lengths()))
