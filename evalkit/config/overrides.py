"""Hydra's overrides parsed and composed the way `@hydra.main` would, and Hydra's own errors (an unknown key, a
malformed override, a value of the wrong type, a mandatory value left unset) as one-line ConfigErrors with their fix:
no torch, so that the planner's command line shares them."""

from __future__ import annotations

import re
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evalkit.config.choices import GROUPS
from evalkit.errors import ConfigError
from evalkit.fields import example, init_fields, unknown_key

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


# Flags with which the command still runs jobs from evalkit's own config; any other (--help, --cfg, -cn, ...) skips
# the check and leaves the command line to Hydra.
RUNNING_FLAGS = {"-m", "--multirun", "-r", "--run"}


MAX_SWEEP_CHECKS = 24  # a sweep's jobs composed and checked up front (~0.2 s each); every job checks itself again


def _first_line(err: BaseException | None) -> str:
    return str(err).strip().splitlines()[0].strip() if err is not None and str(err).strip() else ""


def parse(overrides: list[str]) -> list:
    """Hydra's Override objects; a malformed one is a ConfigError that names it."""
    parser = OverridesParser.create()
    out = []
    for text in overrides:
        try:
            out.append(parser.parse_override(text))
        except HydraException as err:  # OverrideParseException, or the HydraException of a syntax error
            if "=" not in text:
                raise ConfigError(
                    f"the argument {text!r} has no value; write {text}=VALUE (key=value, or group=name)"
                ) from None
            key, _, value = text.lstrip("+~").partition("=")
            wrapped = r"[\w.-]+\([^,\]]*\)[^,\]\"']*"  # chunkkv(snapkv)@0.25: Hydra's grammar reads a call
            first = re.search(wrapped, value)
            if key == "variants" and first:
                quoted = re.sub(wrapped, lambda m: f'"{m.group(0)}"', value)
                slashed = first.group(0).replace("(", "/").replace(")", "")
                raise ConfigError(
                    f"{text!r}: Hydra reads {first.group(0).partition('@')[0]} as a function call: quote the variants "
                    f"that wrap a policy, 'variants={quoted}', or write them as {slashed}"
                ) from None
            reason = next(
                (ln.strip() for ln in str(err).splitlines() if ln.strip() and not ln.startswith(("Error pars", "See"))),
                "syntax error",
            )
            raise ConfigError(
                f"cannot parse the override {text!r} ({reason}); write key=value, a list in brackets and quoted for "
                f"the shell, e.g. 'task.depths=[0.25,0.5]', strings with special characters in quotes (see {GRAMMAR})"
            ) from None
    return out


def jobs(parsed: list, sweep: bool) -> list[list[str]]:
    """The override lists of the jobs to check: the one job, or, with -m, the sweep's first job and then each other
    value of each swept key in turn, the other keys at their first value (every value is checked with every fixed
    override, in 1 + sum(values - 1) compositions rather than the product's; at most MAX_SWEEP_CHECKS). Sweeps that
    cannot be listed without the config (glob) or that are not discrete are left to the jobs."""
    if not sweep:
        return [[o.input_line for o in parsed]]
    axes: dict[str, list[str]] = {}
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            axes[key] = [o.input_line]
        elif o.is_discrete_sweep() and o.value_type != ValueType.GLOB_CHOICE_SWEEP:
            axes[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        else:
            axes.pop(key, None)
    first = [values[0] for values in axes.values()]
    out = [first]
    for i, values in enumerate(axes.values()):
        out += [[*first[:i], value, *first[i + 1 :]] for value in values[1:]]
    return out[:MAX_SWEEP_CHECKS]


def _node_keys(node: DictConfig) -> list[str]:
    """The keys a config node takes: a policy's or task's dataclass fields, or else the node's own keys."""
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if target:
        try:
            return init_fields(get_class(str(target)))
        except Exception:  # noqa: BLE001 - an unloadable target is reported when it is built; list the YAML's keys
            pass
    return sorted(str(k) for k in node.keys() if k not in ("_target_", "hydra"))


def _missing_key(base: DictConfig | None, full_key: str, overrides: list[str]) -> ConfigError:
    """An override names a key that is not in the config: which part is unknown, the nearest valid key, and
    whether the key is one a policy or task takes but its YAML does not list (then `+key=value` adds it)."""
    value = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=", 1)[0] == full_key), "VALUE")
    if base is None:
        return ConfigError(f"unknown key {full_key}; check its spelling against `python -m evalkit --cfg job`")
    parts = full_key.split(".")
    node: Any = base
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        if not isinstance(node, DictConfig):
            named = node._value() if hasattr(node, "_value") else node
            if parent.startswith("policy.") and isinstance(named, str):  # a wrapper's policy by name (ChunkKV's inner)
                fields = f"{{name:{named},{part}:{value}}}" if i == len(parts) - 1 else f"{{name:{named},...}}"
                return ConfigError(
                    f"{parent}={named} names a policy; to set its fields too, write {example(parent, fields)}"
                )
            return ConfigError(f"{parent} is a single value, it has no key {part!r}; write {parent}={value}")
        if part not in node:
            valid = _node_keys(node)
            if part in valid and i == len(parts) - 1:
                return ConfigError(
                    f"{full_key} is not in the {parent} config file, but {parent} takes it: add it with a '+', "
                    f"{example('+' + full_key, value)}"
                )
            return unknown_key(".".join(parts[: i + 1]), valid, parent)
        node = node._get_node(part)
    return ConfigError(f"cannot override {full_key}; check its spelling against `python -m evalkit --cfg job`")


def composition_error(err: Exception, job: list[str], base: DictConfig | None) -> ConfigError:
    cause = err.__cause__ or err.__context__
    text = str(err)
    full_key = getattr(cause, "full_key", None) or ""
    if text.startswith("Could not override") and full_key:
        return _missing_key(base, full_key, job)
    if text.startswith("Could not append to config. An item is already at"):
        key = text.split("'")[1]
        value = next((o.split("=", 1)[1] for o in job if o.lstrip("+").split("=", 1)[0] == key), "VALUE")
        return ConfigError(f"{key} is in the config already: override it without the '+', {example(key, value)}")
    if text.startswith("Could not delete from config"):
        key = text.split("'")[1]
        return ConfigError(
            f"~{key}: {key} is not in the config, so there is nothing to delete; check the key against "
            "`python -m evalkit --cfg job`"
        )
    if text.startswith("Ambiguous value for argument"):
        arg = text.split("'")[1]
        key, _, value = arg.partition("=")
        return ConfigError(
            f"{arg!r} holds a comma: to sweep over the values add -m; for a list write "
            f"{example(key, '[' + value + ']')}; for a string quote it, \"{key}='{value}'\""
        )
    if "requires --multirun" in text:
        return ConfigError(f"{_first_line(err).removeprefix('Sweep parameters ')}: add -m to run the sweep")
    if text.startswith("Error merging override") and isinstance(cause, OmegaConfBaseException):
        return ConfigError(f"{text.split(' ', 3)[3].strip()}: {_first_line(cause)}; fix the value")
    if isinstance(cause, OmegaConfBaseException):
        where = f"{full_key}: " if full_key else ""
        return ConfigError(f"{_first_line(err)}: {where}{_first_line(cause)}; fix the value (see {GRAMMAR})")
    return ConfigError(f"{_first_line(err)}; see {GRAMMAR}")


def compose_job(job: list[str]) -> DictConfig:
    """The job's config as `@hydra.main` composes it (without the hydra node), or a one-line ConfigError."""
    try:
        return compose(config_name="config", overrides=job)
    except (HydraException, OmegaConfBaseException) as err:
        groups = [
            o
            for o in job
            if o.split("=", 1)[0].lstrip("+~").split("@")[0] in (*GROUPS, "hydra.searchpath") or "/" in o.split("=")[0]
        ]
        try:
            base = compose(config_name="config", overrides=groups)
        except (HydraException, OmegaConfBaseException):
            base = None
        raise composition_error(err, job, base) from None


def check_resolved(cfg: DictConfig) -> None:
    """Mandatory values (`???`) left unset and interpolations that do not resolve, as one line each."""
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        where = getattr(err, "full_key", None)
        raise ConfigError(
            f"{where + ': ' if where else ''}{_first_line(err)}; fix the ${{...}} interpolation in its value"
        ) from None
    if missing:
        key = missing[0]
        raise ConfigError(f"{key} must be given (its config leaves it '???'): add {key}=VALUE to the command line")
