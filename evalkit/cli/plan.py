"""The planner's command line: `python -m evalkit.plan model=NAME [plan.KEY=VALUE ...]` (conf/plan.yaml)."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evalkit.config.choices import check_choices
from evalkit.config.overrides import check_resolved, composition_error, parse
from evalkit.errors import ConfigError
from evalkit.exits import guarded
from evalkit.modelspec import ModelSpec
from evalkit.names import safe_name
from evalkit.plan.guide import make_plan
from evalkit.plan.outputs import log_wandb, print_console, write
from evalkit.plan.settings import Settings, settings


def compose(argv: list[str]) -> DictConfig:
    """conf/plan.yaml with the command line's overrides, composed as Hydra does; errors as one-line ConfigErrors."""

    flags = [a for a in argv if a.startswith("-")]
    if flags:
        raise ConfigError(f"{flags[0]}: evalkit.plan takes key=value overrides only (see conf/plan.yaml)")
    check_choices([a for a in argv if a.lstrip("+").partition("=")[0] in ("model", "logger")])  # a run's own check
    parse(argv)
    with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="plan", overrides=argv)
        except (HydraException, OmegaConfBaseException) as err:
            groups = [a for a in argv if a.split("=", 1)[0] in ("model", "logger")]
            try:
                base = hydra_compose(config_name="plan", overrides=groups)
            except (HydraException, OmegaConfBaseException):
                base = None
            raise composition_error(err, argv, base) from None
    check_resolved(cfg)
    return cfg


def plan_settings(cfg: DictConfig) -> Settings:
    """The composed config's plan node as the planner's checked Settings."""
    return settings(OmegaConf.to_container(cfg.plan, resolve=True))


def run(argv: list[str]) -> int:
    return plan_from(compose(argv))


def plan_from(cfg: DictConfig) -> int:
    """The plan a composed config asks for: printed, written to plan.out, and logged to W&B with logger=wandb."""
    s = plan_settings(cfg)
    p = make_plan(ModelSpec.from_mapping(OmegaConf.to_container(cfg.model, resolve=True)), s)
    out = Path(s.out) if s.out else Path(str(cfg.results_root)) / "plan" / safe_name(p["model"])
    print_console(p)
    for path in write(p, out):
        print(f"evalkit: wrote {path}")
    if cfg.logger.name == "wandb":
        logger = OmegaConf.to_container(cfg.logger, resolve=True)
        print(f"evalkit: W&B run written to {log_wandb(logger, OmegaConf.to_container(cfg, resolve=True), p, out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return guarded(lambda: run(sys.argv[1:] if argv is None else argv))
