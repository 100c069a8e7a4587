"""One job of the command line: its run spec (built by the pre-check, or now) run into its folder."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from evalkit.cli.spec import RunSpec, take
from evalkit.kv import contract
from evalkit.run import runner


def job_spec(cfg: DictConfig, out_dir: Path) -> RunSpec:
    """The run spec of a job's config, writing into `out_dir`."""
    return replace(take(cfg), out_dir=out_dir)


def run(spec: RunSpec) -> dict[str, Any]:
    """Run the spec's task with the baseline and its variants (or another engine's, backend=...) into its folder;
    return the summary."""
    with contract.guarding([v.policy for v in spec.variants]):  # a user's policy raising anywhere is its fault: exit 2
        return runner.run(spec)
