"""One job of the command line: its config built into a task, variants and an engine, checked, and run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from evalkit.cli.config import backend, build, validate, variants
from evalkit.kv import contract
from evalkit.run import runner
from evalkit.tasks import Task


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run the configured task with the baseline and the configured variants (or another engine's, backend=...) into
    `out_dir`; return the summary."""
    task: Task = build(cfg.task, "task")
    engine = backend(cfg, task)  # None: evalkit's own engine (backend=hf)
    chosen = variants(cfg) if engine is None else []
    with contract.guarding([v.policy for v in chosen]):  # a user's policy raising anywhere is its fault: exit 2
        validate(cfg, task, [v.policy for v in chosen])
        return runner.run(cfg, out_dir, task, chosen, engine)
