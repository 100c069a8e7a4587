"""One job of the command line: its run spec (built by the pre-check, or now) run into its folder."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from evalkit import contract, sigint
from evalkit.backends import Driven
from evalkit.cli.spec import RunSpec, take
from evalkit.engine.hf import HFEngine
from evalkit.run import runner
from evalkit.run.loop import Engine


def job_spec(cfg: DictConfig, out_dir: Path) -> RunSpec:
    """The run spec of a job's config, writing into `out_dir`."""
    return replace(take(cfg), out_dir=out_dir)


def run(spec: RunSpec) -> dict[str, Any]:
    """Run the spec's task with the baseline and its variants (or another engine's, backend=...) into its folder;
    return the summary."""
    # a user's policy raising anywhere is its fault (exit 2), unless a SIGINT reached the process: the user's stop
    with contract.guarding([v.policy for v in spec.variants], sigint.received):
        return runner.run(spec, engine(spec))


def engine(spec: RunSpec) -> Engine:
    """The engine that answers the run's samples: another (evalkit.backends), lm-eval's driver, or evalkit's own."""
    if spec.engine is not None:
        return Driven(spec.engine, spec.backend)
    if spec.task.external:
        from evalkit.lmeval.evaluate import LmevalEngine  # lm-eval loads only for task=lm_eval

        return LmevalEngine(spec.model, spec.device, spec.task, list(spec.variants), spec.out_dir)
    return HFEngine(spec.model, spec.device, spec.task, list(spec.variants))
