"""`python -m evalkit policy=streaming_llm task=needle`: compose the Hydra config, run, exit with a code.

Exit codes: 0 done (or, with gate=..., PASS), 1 the gate's FAIL, 2 a usage or configuration error (printed on one
line, before any model is loaded).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from evalkit.config import check_choices
from evalkit.errors import ConfigError

OmegaConf.register_new_resolver("evalkit_or", lambda value, default: value or default, replace=True)
# The run folder is named after the policy, or "variants" for a sweep of several.
OmegaConf.register_new_resolver(
    "evalkit_label", lambda policy, variants: "variants" if variants else policy, replace=True
)


def fail(err: ConfigError) -> None:
    print(f"evalkit: error: {err}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path="pkg://evalkit.conf", config_name="config")
def _job(cfg: DictConfig) -> None:
    from evalkit.run import run  # torch and transformers load only once the config is known good

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run(cfg, out_dir)
        if cfg.logger.name == "wandb":
            from evalkit.wandb_log import log_run

            print(f"evalkit: W&B run written to {log_run(cfg, out_dir)}")
        if cfg.gate.name != "none":
            from evalkit.gate import Thresholds, gate, print_verdict

            thresholds = Thresholds(**{k: v for k, v in OmegaConf.to_container(cfg.gate).items() if k != "name"})
            verdict = gate([out_dir], thresholds)
            print_verdict(verdict)
            sys.exit(0 if verdict.passed else 1)
    except ConfigError as err:
        fail(err)


def main() -> None:
    try:
        check_choices(sys.argv[1:])
    except ConfigError as err:
        fail(err)
    _job()


if __name__ == "__main__":
    main()
