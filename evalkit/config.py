"""Config checks that run before any model is loaded: unknown names, impossible budgets and grids."""

from __future__ import annotations

import difflib
from importlib.resources import files

from omegaconf import DictConfig

from evalkit import models
from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy
from evalkit.prompt import PROTOCOLS
from evalkit.tasks import Task

GROUPS = ("model", "policy", "task")


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


def validate(cfg: DictConfig, task: Task, policies: list[KVPolicy]) -> None:
    """Everything that can be known wrong before the model loads."""
    if cfg.protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={cfg.protocol!r} is not one of {list(PROTOCOLS)}")
    task.validate()
    limit = models.max_context(cfg.model) - int(cfg.reserve_tokens)
    too_long = [n for n in task.lengths() if n > limit]
    if too_long:
        raise ConfigError(
            f"context lengths {too_long} exceed what {cfg.model.name} can take: {models.max_context(cfg.model)} "
            f"tokens less {cfg.reserve_tokens} reserved for the question and answer = {limit}; use shorter lengths"
        )
    for policy in policies:
        policy.validate(min(task.lengths()))
