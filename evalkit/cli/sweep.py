"""What happens while a Hydra multirun runs (`python -m evalkit -m policy=h2o,snapkv policy.budget=0.25,0.5`) and
when it ends: each job's figures on the console as it finishes (evalkit.cli.progress); then the jobs' records, under
the sweep folder, merged into one report and, with gate=..., judged by one gate.

Registered as a Hydra callback (conf/config.yaml, hydra.callbacks), so it runs in the launching process whatever the
launcher (basic, joblib, submitit), from before the first job starts until every job has returned.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from evalkit.cli.cores import sweep_size
from evalkit.cli.progress import Progress
from evalkit.errors import EXIT_FAIL, EXIT_INTERNAL, EXIT_OK, ConfigError
from evalkit.exits import error, internal


class Ended(BaseException):
    """The sweep's exit code (0 PASS, 1 FAIL, 2 cannot judge or a bad gate config, 3 a bug in the merge), carried out
    of Hydra to the command line (evalkit.cli.main), which exits with it: Hydra returns nothing of a callback, and
    turns an Exception a callback raises into a warning. A BaseException, like the Interrupted that ends a sweep."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class MergeJobs(Callback):
    def __init__(self) -> None:
        self.progress: Progress | None = None

    def __getstate__(self) -> dict:  # sent with each job to its worker (joblib, submitit): the watcher stays here
        return {"progress": None}

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        total = sweep_size(list(config.hydra.overrides.task))
        self.progress = Progress(Path(config.hydra.sweep.dir), total).start()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        code = merge(config)
        if code is not None:
            raise Ended(code)


def merge(config: DictConfig) -> int | None:
    """The sweep's jobs merged, judged (with gate=...) and reported: the exit code, None where no gate ran and nothing
    broke."""
    try:
        return _merge(config)
    except Exception:  # noqa: BLE001 - a bug: Hydra would print it and exit 1, the gate's FAIL; exit 3 instead
        return internal(traceback.format_exc())


def _merge(config: DictConfig) -> int | None:
    from evalkit.cli.spec import gate_spec

    sweep = Path(config.hydra.sweep.dir)
    try:
        limits = gate_spec(config.gate)  # None for gate=none
    except ConfigError as err:
        return error(err)
    code = None
    if limits is not None:
        code = _judge(sweep, limits.thresholds)
    reported = _report(sweep)
    if limits is not None and OmegaConf.select(config, "logger.name") == "wandb":
        _log_wandb(sweep)
    return code if code is not None or reported else EXIT_INTERNAL


def _judge(sweep: Path, limits) -> int:
    """The sweep judged once, by the gate (its one look): the exit code."""
    from evalkit.gate.gating import gate
    from evalkit.gate.outputs import print_verdict

    try:
        verdict = gate([sweep], limits)
    except ConfigError as err:  # CannotJudge (the gate printed its reasons), or no records at all
        return error(err)
    print_verdict(verdict)
    return EXIT_OK if verdict.passed else EXIT_FAIL


def _log_wandb(sweep: Path) -> None:
    """Every job's W&B runs logged once the sweep's one gate has judged them all (each job recorded where they go in
    its wandb.json, evalkit.cli.main): whole, with the sweep's verdict and its merged report. A job without records
    (it failed) has no W&B run."""
    from evalkit.cli.gate import log_wandb

    try:
        log_wandb([sweep], sweep)
    except ConfigError as err:  # no job wrote records
        print(f"evalkit: no W&B run written: {err}")


def _report(sweep: Path) -> bool:
    """The merged report, which shows the gate's verdict.json (it never judges); False where a bug broke it. A bug
    in it is printed with its traceback and the request for a report, but the exit code stays the gate's: the report
    never replaces the verdict (exit 3 only where no gate ran)."""
    from evalkit.report.build import report

    try:
        written = report([sweep], sweep / "report")
        print(f"evalkit: merged report of the sweep: {written[0]}")
    except ConfigError as err:  # no job wrote records (all failed or were interrupted before a sample)
        print(f"evalkit: no merged report: {err}")
    except Exception:  # noqa: BLE001 - a bug in the report: said, but the gate's exit code stands
        internal(traceback.format_exc())
        return False
    return True
