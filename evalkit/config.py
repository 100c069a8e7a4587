"""Config checks that run before any model is loaded: unknown names and keys, values of the wrong type, impossible
budgets and grids, a device that is not there."""

from __future__ import annotations

import dataclasses
import difflib
from importlib.resources import files

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from evalkit import models
from evalkit.engine import Variant
from evalkit.errors import ConfigError
from evalkit.hydra_errors import cli, describe, fits, init_fields, unknown_key
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


def build(node: DictConfig, group: str):
    """Instantiate a policy or task config (`_target_` + its keys) into its dataclass; a key the class does not take,
    or a target that does not load, is a one-line ConfigError."""
    target = str(node.get("_target_") or "")
    try:
        cls = get_class(target)
    except Exception as err:  # noqa: BLE001 - hydra wraps import errors in several types
        raise ConfigError(f"{group}._target_={target!r} cannot be imported ({err}); fix _target_ in its YAML") from None
    valid = init_fields(cls)
    unknown = sorted(str(k) for k in node.keys() if k != "_target_" and k not in valid)
    if unknown:
        raise unknown_key(f"{group}.{unknown[0]}", valid, group)
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"{group}: cannot build {cls.__name__} ({cause}); check the {group}.* values") from None


def quant_spec(node: DictConfig) -> QuantSpec | None:
    """The storage a conf/quant config asks for; None for full precision."""
    if node.get("bits") is None:
        return None
    for key in ("bits", "group", "residual"):
        if key in node and not fits(node[key], int):
            raise ConfigError(f"quant.{key}={node[key]!r} is not a whole number; give e.g. quant.{key}=64")
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
    listed = cfg.get("variants")
    if listed and not isinstance(listed, (list, ListConfig)):
        raise ConfigError(f"variants={listed!r} is not a list; write e.g. 'variants=[snapkv@0.25,h2o@0.5+int4]'")
    if not listed:
        out = [Variant(build(cfg.policy, "policy"), quant_spec(cfg.quant))]
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
        build(node.policy, "policy"),
        quant_spec(_named("quant", quant, spec)) if quant else None,
        int(chunk[5:]) if chunk else None,
    )


# Top-level settings: their type, and an example to give.
SETTINGS = {"seed": (int, 0), "reserve_tokens": (int, 256), "resume": (bool, False), "results_root": (str, "results")}


def check_settings(cfg: DictConfig) -> None:
    """The top-level settings (seed, device, protocol, ...): types, ranges, and a device that is there."""
    for key, (kind, default) in SETTINGS.items():
        value = cfg.get(key, default)
        if not fits(value, kind):
            raise ConfigError(f"{key}={value!r} is not {describe(kind)}; give e.g. {key}={cli(default)}")
    if cfg.get("reserve_tokens", 0) < 0:
        raise ConfigError(f"reserve_tokens={cfg.reserve_tokens} is negative; give a number of tokens such as 256")
    if cfg.get("protocol") not in PROTOCOLS:
        raise ConfigError(f"protocol={cfg.get('protocol')!r} is not one of {list(PROTOCOLS)}")
    models.check_device(cfg.get("device", "auto"))
    limit = (cfg.get("model") or {}).get("max_context")
    if not fits(limit, int | None) or (limit is not None and limit < 1):
        raise ConfigError(
            f"model.max_context={limit!r} is not a positive whole number of tokens (or null, to "
            "read it from an hf model's config); give e.g. model.max_context=4096"
        )
    prefill = cfg.get("prefill") or {}
    if not fits(prefill.get("compare_oneshot", False), bool):
        raise ConfigError(
            f"prefill.compare_oneshot={prefill.compare_oneshot!r} is not true or false; "
            "give prefill.compare_oneshot=true"
        )


def check(cfg: DictConfig) -> None:
    """Every check that needs no model, on a composed config: what `run` checks before it loads one, run up front
    for every job of a command (evalkit.hydra_errors.precheck)."""
    task = build(cfg.task, "task")
    validate(cfg, task, [v.policy for v in variants(cfg)])


def validate(cfg: DictConfig, task: Task, policies: list[KVPolicy]) -> None:
    """Everything that can be known wrong before the model loads."""
    check_settings(cfg)
    task.validate()  # its fields against their annotations first (Task.validate), then its own checks
    models.check_source(cfg.model)
    models.check_attention(cfg.model)
    if task.teacher_forced and cfg.protocol != "query_agnostic":
        raise ConfigError(
            f"task={task.name} teacher-forces a continuation that is never compressed: use protocol=query_agnostic"
        )
    if not task.lengths():  # lengths known only per sample (JSONL): checked as each sample is tokenized
        for policy in policies:
            policy.validate(None)
        return
    try:
        limit = models.max_context(cfg.model) - int(cfg.reserve_tokens)
    except OSError as err:
        raise ConfigError(
            f"model.name_or_path={cfg.model.name_or_path!r}: its config could not be read ({_first(err)}); give a "
            "local folder with config.json or a Hub id on a machine that reaches the Hub, or set model.max_context"
        ) from None
    too_long = [n for n in task.lengths() if n > limit]
    if too_long:
        raise ConfigError(
            f"context lengths {too_long} exceed what {cfg.model.name} can take: {models.max_context(cfg.model)} "
            f"tokens less {cfg.reserve_tokens} reserved for the question and answer = {limit}; use shorter lengths"
        )
    for policy in policies:
        policy.validate(min(task.lengths()))


def _first(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
