"""Config checks that run before any model is loaded: unknown names and keys, values of the wrong type, impossible
budgets and grids, a device that is not there."""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from contextlib import contextmanager

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evalkit import contract, sigint
from evalkit.backends import Backend, BackendSpec
from evalkit.cli.params import policy_keys
from evalkit.config.choices import check_shadowed, options, searchpath, unknown_choice
from evalkit.engine import models
from evalkit.errors import ConfigError
from evalkit.fields import cli, describe, fits, init_fields, unknown_key
from evalkit.kv.quantized import QuantSpec
from evalkit.kv.variant import Variant
from evalkit.modelspec import ModelSpec
from evalkit.policies import KVPolicy
from evalkit.tasks import Task
from evalkit.tasks.prompt import PROTOCOLS


@contextmanager
def _hydra_ready():
    """Hydra's global state for `compose`: the running job's, or evalkit's conf/ for the time of the call."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
        yield


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def load_option(group: str, name: str, where: str = "", within: str = "") -> DictConfig:
    """The config `group=name` gives, composed by Hydra (so a user's YAML may extend another with a defaults list),
    from evalkit's conf/ or the active search path; `where` and `within` place the errors."""
    path = searchpath()
    if name not in options(group, path):
        raise unknown_choice(group, name, path, where, within)
    check_shadowed(group, name, path)
    overrides = [f"+{group}={name}"]
    if path:
        overrides.append(f"hydra.searchpath=[{','.join(_quoted(p) for p in path)}]")
    try:
        with _hydra_ready():
            node = compose(config_name=None, overrides=overrides)[group]
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(f"{where}{group} {name!r}{within} does not compose ({_first(err)}); fix its YAML") from None
    OmegaConf.set_struct(node, False)
    return node


def load_class(target: str, group: str, name: object = None) -> type:
    """The class `_target_` names, or a one-line ConfigError (not importable, not a class)."""
    module, _, attr = target.rpartition(".")
    if not target:
        which = f"{group} {name!r}" if name else group
        raise ConfigError(f"{which} has no _target_: name its class in its YAML, e.g. _target_: mypkg.MyPolicy")
    try:
        obj = getattr(importlib.import_module(module), attr) if module else None
    except Exception as err:  # noqa: BLE001 - any error while importing the user's module
        raise ConfigError(
            f"{group}._target_={target!r} cannot be imported ({type(err).__name__}: {_first(err)}); make "
            f"{module or target!r} importable (on PYTHONPATH, or pip install -e your package) and fix _target_"
        ) from None
    if not isinstance(obj, type):
        raise ConfigError(f"{group}._target_={target!r} is not a class in module {module!r}; fix _target_")
    return obj


def wrapped_fields(cls: type) -> list[str]:
    """The fields of a wrapper policy that hold another policy (ChunkKV's `inner`)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - annotations a user's class cannot resolve: no wrapped policy
        return []

    def is_policy(hint) -> bool:
        if typing.get_origin(hint) is not None:
            return any(is_policy(a) for a in typing.get_args(hint))
        return isinstance(hint, type) and issubclass(hint, KVPolicy)

    return [f.name for f in dataclasses.fields(cls) if f.init and is_policy(hints.get(f.name))]


def build(node: DictConfig, group: str):
    """Instantiate a policy or task config (`_target_` + its keys) into its dataclass; a key the class does not take,
    a target that does not load, or a policy that is not a KVPolicy, is a one-line ConfigError. A wrapper's policy
    (ChunkKV's `inner`: a name, a mapping, or a full config) is built first (policy_from)."""
    target = str(node.get("_target_") or "")
    cls = load_class(target, group, node.get("name"))
    if group.startswith("policy"):
        if not issubclass(cls, KVPolicy):
            raise ConfigError(
                f"{group}._target_={target!r} is not a policy: subclass evalkit.policies.KVPolicy "
                "(see README, Write a policy)"
            )
        if "__dataclass_fields__" not in cls.__dict__:
            raise ConfigError(
                f"{group}._target_={target!r}: decorate the class with @dataclass(kw_only=True), as KVPolicy is, "
                "so that its fields are config keys"
            )
    valid = init_fields(cls)
    unknown = sorted(str(k) for k in node.keys() if k != "_target_" and k not in valid)
    if unknown:
        raise unknown_key(f"{group}.{unknown[0]}", valid, group)
    wrapped = wrapped_fields(cls) if group.startswith("policy") else []
    try:
        if not wrapped:
            return instantiate(node, _convert_="all")
        seed = OmegaConf.select(node._get_root(), "seed", default=0)
        inner = {f: policy_from(node[f], f"{group}.{f}", seed) for f in wrapped if f in node}
        rest = {k: v for k, v in node.items() if k != "_target_" and k not in wrapped}
        return cls(**OmegaConf.to_container(OmegaConf.create(rest), resolve=True), **inner)
    except InstantiationException as err:
        cause = err.__cause__ or err
        raise ConfigError(f"{group}: cannot build {cls.__name__} ({cause}); check the {group}.* values") from None
    except TypeError as err:
        raise ConfigError(f"{group}: cannot build {cls.__name__} ({err}); check the {group}.* values") from None


def policy_from(spec, where: str = "policy", seed: int = 0) -> KVPolicy:
    """A policy from what a config gives for one: a name (`snapkv`, `chunkkv(snapkv)`), a mapping with a name and
    fields to set (`{name: snapkv, window: 16}`), a full config (`{_target_: ..., ...}`), or a KVPolicy."""
    if isinstance(spec, KVPolicy):
        return spec
    if isinstance(spec, dict):
        spec = OmegaConf.create(spec)
    if isinstance(spec, str):
        node = policy_node(spec, f"{where}: ")
    elif isinstance(spec, DictConfig) and "_target_" in spec:
        node = spec
    elif isinstance(spec, DictConfig) and isinstance(spec.get("name"), str):
        node = OmegaConf.merge(policy_node(spec.name, f"{where}: "), spec)
    else:
        raise ConfigError(
            f"{where}={spec!r}: give a policy's name, e.g. {where}=snapkv, or its name and fields, "
            f"'{where}={{name:snapkv,window:16}}'"
        )
    holder = OmegaConf.create({"seed": seed, "policy": node})  # the root of ${seed} in a policy's YAML
    return build(holder.policy, where)


WRAPPER = re.compile(r"([A-Za-z0-9_.-]+)(?:\((.+)\)|/(.+))")


def policy_node(name: str, where: str = "", within: str = "") -> DictConfig:
    """The config of a policy named as in `variants=[...]`: `snapkv`, or a wrapper over another policy,
    `chunkkv(snapkv)` or `chunkkv/snapkv` (nested: `chunkkv(adakv(snapkv))`)."""
    match = WRAPPER.fullmatch(name)
    if not match:
        return load_option("policy", name, where, within)
    outer, inner = match.group(1), match.group(2) or match.group(3)
    node = load_option("policy", outer, where, within)
    fields = wrapped_fields(load_class(str(node.get("_target_") or ""), f"{where}policy {outer}"))
    if not fields:
        raise ConfigError(
            f"{where}{outer}{within or f' in {name!r}'} wraps no policy: write it alone, or wrap {inner!r} in a "
            f"wrapper such as chunkkv({inner})"
        )
    node[fields[0]] = policy_node(inner, where, within)
    return node


def quant_spec(node: DictConfig) -> QuantSpec | None:
    """The storage a conf/quant config asks for; None for full precision."""
    if node.get("bits") is None:
        return None
    for key in ("bits", "group", "residual"):
        if key in node and not fits(node[key], int):
            raise ConfigError(f"quant.{key}={node[key]!r} is not a whole number; give e.g. quant.{key}=64")
    cpu_path = node.get("cpu_path", "dequantized-cache")
    if node.get("format") == "e4m3":
        spec = QuantSpec(name=node.name, bits=8, format="e4m3", cpu_path=cpu_path)
    else:
        spec = QuantSpec(
            name=node.name, bits=int(node.bits), group=int(node.group), residual=int(node.residual), cpu_path=cpu_path
        )
    spec.validate()
    return spec


def _named(group: str, name: str, spec: str) -> DictConfig:
    if group == "policy":
        return policy_node(name, "variants: ", f" in {spec!r}")
    return load_option(group, name, "variants: ", f" in {spec!r}")


def listed_entries(cfg: DictConfig) -> list[tuple[str, dict]]:
    """`variants=[...]` as written: each entry's spec and the policy fields it sets. An entry is a spec string
    (`snapkv@0.25`), or a mapping of its spec and fields of the policy, such as a learned method's weights:
    `{variant:kvzap@0.25,weights_path:/data/kvzap}` (empty: none listed)."""
    listed = cfg.get("variants")
    if listed and not isinstance(listed, (list, ListConfig)):
        raise ConfigError(f"variants={listed!r} is not a list; write e.g. 'variants=[snapkv@0.25,h2o@0.5+int4]'")
    out = []
    for entry in listed or ():
        if not isinstance(entry, (dict, DictConfig)):
            out.append((str(entry), {}))
            continue
        fields = dict(OmegaConf.to_container(entry, resolve=True) if isinstance(entry, DictConfig) else entry)
        spec = fields.pop("variant", None)
        if not isinstance(spec, str) or not spec:
            raise ConfigError(
                f"variants: the entry {fields} names no variant; write it as "
                "'{variant:kvzap@0.25,weights_path:DIR}' (the spec, then fields of its policy)"
            )
        out.append((spec, fields))
    return out


def listed_variants(cfg: DictConfig) -> tuple[str, ...]:
    """`variants=[...]` as written, each entry's spec string (empty: none listed)."""
    return tuple(spec for spec, _ in listed_entries(cfg))


def variants(cfg: DictConfig, made: list[Variant] | None = None) -> list[Variant]:
    """The variants a run evaluates: `variants=[snapkv@0.25,h2o@0.5+int4,h2o@1024:chunk512]` when given, else
    `policy` + `quant`.

    Each is its policy's YAML with the budget after '@' (a fraction like 0.25 or a token count like 512), after
    '+' a conf/quant storage, and after ':chunk' the chunk size of a chunked prefill. `prefill=chunked` prefills
    every variant in chunks of `prefill.chunk` tokens and, with `prefill.compare_oneshot`, also runs each one-shot,
    on the same samples, for the side-by-side comparison. `made`: the variants a budget search made instead.
    """
    listed = listed_variants(cfg)
    if made:  # a budget search's (evalkit.cli.search)
        out = list(made)
    elif not listed:
        out = [Variant(build(cfg.policy, "policy"), quant_spec(cfg.quant))]
    else:
        out = [parse_variant(cfg, spec, fields) for spec, fields in listed_entries(cfg)]
    prefill = cfg.get("prefill") or {}
    if prefill.get("name", "oneshot") not in ("oneshot", "chunked"):
        raise ConfigError(f"prefill={prefill.get('name')!r} is not one of ['chunked', 'oneshot']")
    if prefill.get("name") == "chunked":
        chunked = [dataclasses.replace(v, chunk=prefill.get("chunk") if v.chunk is None else v.chunk) for v in out]
        out = ([v for v in out if v.chunk is None] if prefill.get("compare_oneshot") else []) + chunked
    for v in out:
        with (
            contract.guarding([v.policy], sigint.received),
            policy_keys(cfg, v.name),
        ):  # a user's policy's fault: exit 2
            v.validate()
    names = [v.name for v in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"variants: {sorted({n for n in names if names.count(n) > 1})} are listed more than once")
    return out


def parse_variant(cfg: DictConfig, spec: str, fields: dict | None = None) -> Variant:
    """`NAME@BUDGET[+QUANT][:chunkN]` -> Variant; `fields`: settings of its policy (`weights_path`), set before the
    budget."""
    head, _, chunk = spec.partition(":")
    head, _, quant = head.partition("+")
    name, sep, budget = head.partition("@")
    node = OmegaConf.create({"seed": cfg.seed, "policy": _named("policy", name, spec)})
    if fields:  # the fields of its class (a YAML need not list them all), less the budget that '@' gives
        valid = sorted(
            f for f in init_fields(load_class(str(node.policy.get("_target_") or ""), "policy")) if f != "budget"
        )
        for key, value in fields.items():
            if key not in valid:
                raise ConfigError(f"variants: {spec!r} has no policy field {key!r}; its fields are {valid}")
            node.policy[key] = value
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


def backend(node: DictConfig, spec: BackendSpec, task: Task) -> Backend:
    """The engine of a run other than evalkit's own (`backend=llamacpp`, `backend=openai`: evalkit.backends), built
    from conf/backend and checked, nothing loaded or contacted yet."""
    engine = build(node, "backend")
    engine.check(spec, task)
    return engine


def validate(cfg: DictConfig, model: ModelSpec, task: Task, chosen: list[Variant]) -> None:
    """What the task, the model and the variants' policies can be known to get wrong together before the model loads;
    a policy's parameter named as the user wrote it (evalkit.cli.params)."""
    policies = [v.policy for v in chosen]
    task.validate()  # its fields against their annotations first (Task.validate), then its own checks
    models.check_source(model)
    models.check_attention(model)
    if task.teacher_forced and cfg.protocol != "query_agnostic":
        raise ConfigError(
            f"task={task.name} teacher-forces a continuation that is never compressed: use protocol=query_agnostic"
        )
    for policy in policies:
        if policy.reads_question and cfg.protocol != "query_aware":  # a wrapper's: its inner policy's
            raise ConfigError(
                f"{policy.name} scores the context by its question's attention, and protocol={cfg.protocol} compresses "
                "the context without the question: use protocol=query_aware"
            )
    if not task.lengths():  # lengths known only per sample (JSONL): checked as each sample is tokenized
        for v in chosen:
            with contract.calling(v.policy, "check_params"), policy_keys(cfg, v.name):
                contract.check_policy(v.policy, None)
        return
    try:
        limit = models.max_context(model) - int(cfg.reserve_tokens)
    except OSError as err:
        raise ConfigError(
            f"model.name_or_path={model.name_or_path!r}: its config could not be read ({_first(err)}); give a "
            "local folder with config.json or a Hub id on a machine that reaches the Hub, or set model.max_context"
        ) from None
    too_long = [n for n in task.lengths() if n > limit]
    if too_long:
        raise ConfigError(
            f"context lengths {too_long} exceed what {model.name} can take: {models.max_context(model)} "
            f"tokens less {cfg.reserve_tokens} reserved for the question and answer = {limit}; use shorter lengths"
        )
    for v in chosen:
        with contract.calling(v.policy, "check_params"), policy_keys(cfg, v.name):
            contract.check_policy(v.policy, min(task.lengths()))


def _first(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
