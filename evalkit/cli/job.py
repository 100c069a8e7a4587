"""One job of the command line: its run spec, built with its folder, and its parts (the pre-check's), run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from evalkit import contract, sigint
from evalkit.backends import Driven
from evalkit.cli.spec import Parts, job_key, parts, run_spec
from evalkit.engine.hf import HFEngine
from evalkit.run import runner
from evalkit.run.interrupt import Stop
from evalkit.run.loop import Engine
from evalkit.runspec import RunSpec


def job_spec(cfg: DictConfig, out_dir: Path, built: Parts | None = None) -> tuple[RunSpec, Parts]:
    """The run spec of a job's config, writing into `out_dir`, and the objects it names: `built`, the pre-check's,
    never built again; None: built here, without the checks against the model (a config the caller checked)."""
    return run_spec(cfg, out_dir), built if built is not None else parts(cfg, check=False)


def handed(prechecked: dict[tuple[str, ...], Parts], cfg: DictConfig, overrides: list[str], in_sweep: bool) -> Parts:
    """A job's parts: those the pre-check built for it, taken out of `prechecked` (a command's one job, or the
    sweep's job its overrides name: evalkit.cli.spec.job_key), or else built and checked here (a sweep's job the
    pre-check left to the jobs, or one in a worker process)."""
    if len(prechecked) == 1 and not in_sweep:
        return prechecked.popitem()[1]
    built = prechecked.pop(job_key(overrides), None)
    return built if built is not None else parts(cfg)


def use_threads(threads: int) -> None:
    """Torch's intra-op threads in this process: a sweep's job's share of the cores (evalkit.cli.cores)."""
    torch.set_num_threads(threads)


def run(spec: RunSpec, built: Parts, stop: Stop | None = None) -> dict[str, Any]:
    """Run the spec's task with the baseline and its variants (or another engine's, backend=...) into its folder,
    until `stop` is asked (the command's Ctrl-C; None: a stop no signal asks); return the summary."""
    # a user's policy raising anywhere is its fault (exit 2), unless a SIGINT reached the process: the user's stop
    with contract.guarding([v.policy for v in built.variants], sigint.received):
        return runner.run(spec, built.task, built.variants, engine(spec, built), stop or Stop())


def engine(spec: RunSpec, built: Parts) -> Engine:
    """The engine that answers the run's samples: another (evalkit.backends), lm-eval's driver, or evalkit's own."""
    if built.engine is not None:
        return Driven(built.engine, built.backend)
    if built.task.external:
        from evalkit.lmeval.evaluate import LmevalEngine  # lm-eval loads only for task=lm_eval

        return LmevalEngine(spec.model, spec.device, built.task, list(built.variants), spec.out_dir)
    return HFEngine(spec.model, spec.device, built.task, list(built.variants))
