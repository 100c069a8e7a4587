"""Weights & Biases: one W&B run per evalkit run, grouped by experiment, so runs compare in the W&B UI.

Logs the resolved config, summary metrics per variant (`<variant>/accuracy`, `/drop`, `/kv_ratio`, ...), the
per-sample table and the report's plots. Offline unless an API key is configured (`wandb sync` uploads later).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from evalkit.gate.summary import summarize
from evalkit.records import SAMPLES, read_rows
from evalkit.report.cli import report

COLUMNS = [
    "sample_id",
    "variant",
    "cell",
    "score",
    "baseline_score",
    "flip",
    "prediction",
    "kv_bytes",
    "kv_bytes_baseline",
    "context_tokens",
]


def mode(cfg: DictConfig) -> str:
    """`online` only when asked for and an API key is configured; offline otherwise."""
    wanted = cfg.get("mode") or "auto"
    if wanted == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wanted


def log_run(cfg: DictConfig, out_dir: Path) -> Path:
    """Log an evalkit run folder to W&B; returns the local W&B run folder."""
    import wandb

    rows = read_rows(out_dir / SAMPLES)
    summary = summarize(rows)
    images = [p for p in report([out_dir], out_dir / "report") if p.suffix == ".png"]
    logger = cfg.logger
    run = wandb.init(
        project=logger.project,
        entity=logger.get("entity"),
        group=logger.get("group") or cfg.task.name,
        name=out_dir.name,
        mode=mode(logger),
        dir=str(out_dir),
        config=OmegaConf.to_container(cfg, resolve=True),
        reinit="finish_previous",
    )
    metrics = {}
    for variant, s in summary.items():
        for key in (
            "accuracy",
            "baseline_accuracy",
            "lost",
            "gained",
            "kv_ratio",
            "kv_ratio_measured",
            "kv_bytes",
            "kl_mean",
        ):
            if key in s:
                metrics[f"{variant}/{key}"] = s[key]
        metrics[f"{variant}/drop"] = s["paired"]["drop"]
        metrics[f"{variant}/drop_upper_bound"] = s["paired"]["drop_bounds"][1]
        metrics[f"{variant}/mcnemar_p"] = s["paired"]["mcnemar_p"]
    table = wandb.Table(columns=COLUMNS, data=[[_cell(r.get(c)) for c in COLUMNS] for r in rows])
    run.log({**metrics, "samples": table, **{f"plots/{p.stem}": wandb.Image(str(p)) for p in images}})
    local = Path(run.dir).parent
    run.finish()
    return local


def _cell(value: Any) -> Any:
    return str(value) if isinstance(value, dict) else value
