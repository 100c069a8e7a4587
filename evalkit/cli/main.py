"""`python -m evalkit policy=streaming_llm task=needle`: compose the Hydra config, run, exit with a code.

Exit codes: 0 done (or, with gate=..., PASS), 1 the gate's FAIL, 2 a usage or configuration error (printed on one
line, before any model is loaded), 130 stopped by Ctrl-C after the sample in flight (the command to resume is
printed). `-m` runs a sweep through Hydra's launcher (`hydra/launcher=joblib` for parallel jobs); its jobs' records
are merged into one report, and judged by one gate.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from evalkit.cli.cores import job_threads, sweep_size
from evalkit.cli.params import as_written
from evalkit.cli.sweep import Ended
from evalkit.config.choices import check_choices
from evalkit.config.overrides import RUNNING_FLAGS
from evalkit.errors import EXIT_USAGE, CannotJudge, ConfigError, InternalError, JobError, ParamError
from evalkit.exits import error, internal
from evalkit.names import safe_name
from evalkit.records import SAMPLE_COUNT
from evalkit.run import interrupt

# Overrides left out of a run's folder name: they do not change its records (or, for the group choices, the folder
# path names them already), or, for the task's sample count (records.SAMPLE_COUNT), they extend the same run: the
# advice's `task.samples_per_cell=8 resume=true` continues the run's own folder and its looks. A sweep's jobs keep
# the count in their folder names: a sweep over counts runs each in a folder of its own.
SAME_RECORDS = ("resume", "results_root", "device", "model", "task", "policy")
NOT_RECORDS = ("gate", "logger", "hydra")


def dirname(overrides, count: bool = False) -> str:
    """The run folder's last part: the sorted overrides that change the records, `k=v,k=v`, or `default`, made safe
    as one folder name (safe_name)."""
    keep = []
    for item in overrides:
        key = str(item).lstrip("+~").split("=", 1)[0]
        if key in SAME_RECORDS or key.split(".", 1)[0] in NOT_RECORDS or key.startswith("hydra/"):
            continue
        if not count and key.startswith("task.") and key.removeprefix("task.") in SAMPLE_COUNT:
            continue
        keep.append(str(item).lstrip("+~"))
    return safe_name(",".join(sorted(keep)) or "default")


def label(policy, variants, budgets=None) -> str:
    """The run folder is named after the policy, or "variants" for several, or "search" for a budget search."""
    return "search" if budgets else "variants" if variants else safe_name(policy)


def register_resolvers() -> None:
    """The resolvers that name the run folders (conf/config.yaml: hydra.run.dir, hydra.sweep.subdir), registered by
    the command line at start-up (main) and by a sweep's worker process as it receives its first job (in_worker)."""
    OmegaConf.register_new_resolver("evalkit_label", label, replace=True)
    OmegaConf.register_new_resolver("evalkit_dirname", dirname, replace=True)
    OmegaConf.register_new_resolver(
        "evalkit_job_dirname", lambda overrides: dirname(overrides, count=True), replace=True
    )
    OmegaConf.register_new_resolver("evalkit_safe", safe_name, replace=True)


NOT_RUNNING = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")


def running(argv: list[str]) -> bool:
    """A command line that runs jobs (no flag but -m): the pre-check composes and checks each of them."""
    return not ({a.split("=", 1)[0] for a in argv if a.startswith("-")} - RUNNING_FLAGS)


def fail(err: ConfigError | JobError) -> None:
    sys.exit(error(err))


def overrides(argv: list[str]) -> dict[str, str]:
    """`key=value` arguments of the command line."""
    return dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))


def sweeping(argv: list[str]) -> bool:
    return bool({"-m", "--multirun"} & set(argv))


class HydraJob:
    """What Hydra runs for each job of the command line (its task function): the run spec built with its folder and
    run with the parts the pre-check built for it (`prechecked`, by job_key; a job it did not build builds and checks
    its own), until the command's `stop` is asked, logged, gated. A sweep's worker process (joblib) receives it
    pickled, without the parts (objects of this process): there it starts as the command line does (in_worker), with
    the stop request its command had when it sent the job. `jobs`: how many jobs the command's sweep runs (None: not a
    sweep, or not counted), which with the launcher says each job's share of the cores."""

    def __init__(self, stop: interrupt.Stop, prechecked: dict | None = None, jobs: int | None = None) -> None:
        self.stop = stop
        self.prechecked = dict(prechecked or {})
        self.jobs = jobs

    def __reduce__(self):
        return in_worker, (self.stop.requested(), self.jobs)

    def __call__(self, cfg: DictConfig) -> None:
        hc = HydraConfig.get()
        in_sweep = hc.mode == RunMode.MULTIRUN
        try:
            self._run(cfg, hc, in_sweep)
        except ConfigError as err:
            where = f"[{' '.join(hc.overrides.task)}] " if in_sweep else ""
            named = as_written(err, cfg) if isinstance(err, ParamError) else err
            raise JobError(f"{where}{named}") from None
        except Exception:  # a bug: Hydra would print it and exit 1, the gate's FAIL; carry it out as exit 3 instead
            raise InternalError(traceback.format_exc()) from None

    def _run(self, cfg: DictConfig, hc, in_sweep: bool) -> None:
        from evalkit.cli.job import handed, job_spec, run, use_threads

        out_dir = Path(hc.runtime.output_dir)
        threads = job_threads(hc.launcher, self.jobs) if in_sweep else None
        if threads is not None:  # the jobs that run at once share the cores instead of each taking them all
            use_threads(threads)
        _inside_results_root(cfg, hc, out_dir)
        spec, built = job_spec(cfg, out_dir, handed(self.prechecked, cfg, list(hc.overrides.task), in_sweep))
        with self.stop.deferred():
            run(spec, built, self.stop)
        verdict, undecided = None, None
        if built.gate is not None and not in_sweep:  # a sweep is gated once, on all its jobs (evalkit.cli.sweep)
            from evalkit.gate.gating import gate
            from evalkit.gate.outputs import print_verdict

            try:
                verdict = gate([out_dir], built.gate.thresholds)
                print_verdict(verdict)
            except CannotJudge as err:  # printed, verdict.json written: logged to W&B below, then raised
                undecided = err
        if spec.logger.name == "wandb":  # gated first, logged once: the W&B runs hold the verdict
            _log_wandb(out_dir, spec.logger, built.gate.values if built.gate is not None else None, in_sweep)
        if undecided is not None:
            raise undecided
        if verdict is not None:
            sys.exit(0 if verdict.passed else 1)


def _log_wandb(out_dir: Path, lg, thresholds: dict | None, in_sweep: bool) -> None:
    """The run logged to W&B after its gate, whole (evalkit.report.wandb_log). A gated sweep's job records only where
    its runs go: the sweep logs every job once its one gate has judged them all (evalkit.cli.sweep)."""
    from evalkit.report import wandb_log

    if in_sweep and thresholds is not None:
        wandb_log.record_target(out_dir, lg.project, lg.group, lg.entity, lg.mode)
        return
    local = wandb_log.log_run(out_dir, lg.project, lg.group, lg.entity, lg.mode, thresholds)
    print(f"evalkit: W&B runs written to {', '.join(map(str, local))}")


def in_worker(stopped: bool, jobs: int | None = None) -> HydraJob:
    """A sweep's job arriving in a worker process, before Hydra names its folder: the process set up as the command
    line sets up its own (the folder resolvers; Ctrl-C deferred for the rest of the worker, to the one stop its
    handler asks), the stop asked if the command's was when it sent the job."""
    register_resolvers()
    stop = interrupt.Stop.of_this_process() or interrupt.Stop()
    if stopped:
        stop.request()
    stop.defer()
    return HydraJob(stop, jobs=jobs)


def run_jobs(stop: interrupt.Stop, prechecked: dict | None = None, jobs: int | None = None) -> None:
    """Hydra runs the command line's job, or its sweep's `jobs` jobs, with `stop` as their stop request and the parts
    the pre-check built for them (`prechecked`, by job_key)."""
    job = HydraJob(stop, prechecked, jobs)
    hydra.main(version_base="1.3", config_path="pkg://evalkit.conf", config_name="config")(job)()


def _inside_results_root(cfg: DictConfig, hc, out_dir: Path) -> None:
    """A folder named by evalkit's pattern (not given with hydra.run.dir / hydra.sweep.dir) lies in results_root."""
    if any(o.split("=", 1)[0] in ("hydra.run.dir", "hydra.sweep.dir") for o in hc.overrides.hydra):
        return
    root = Path(str(cfg.results_root)).resolve()
    if not out_dir.resolve().is_relative_to(root):
        raise ConfigError(f"the run folder {out_dir} lies outside results_root={root}; name it with hydra.run.dir=...")


def results_folder(argv: list[str]) -> Path:
    """The folder a run (or sweep) writes under, read from the command line before Hydra creates it."""
    values = overrides(argv)
    key = "hydra.sweep.dir" if sweeping(argv) else "hydra.run.dir"
    folder = values.get(key) or values.get("results_root") or "results"
    parts = Path(folder).parts
    fixed = [p for p in parts[: next((i for i, p in enumerate(parts) if "$" in p), len(parts))]]
    return Path(*fixed) if fixed else Path(".")


def check_writable(folder: Path) -> None:
    """Create the results folder and a file in it now: an unwritable place fails here, in one line, not in Hydra."""
    probe = folder / f".evalkit-write-test-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except OSError as err:
        raise ConfigError(
            f"cannot write results under {folder} ({err.strerror or err}); choose a writable folder with "
            "results_root=PATH, or fix its permissions or free space"
        ) from None
    finally:  # also when a Ctrl-C lands between the two
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)


def resume_command(argv: list[str]) -> str:
    args = [a for a in argv if not a.startswith("resume=")] + ["resume=true"]
    return "python -m evalkit " + " ".join(shlex.quote(a) for a in args)


def name_the_sweep(argv: list[str]) -> list[str]:
    """A sweep without hydra.sweep.dir gets Hydra's default folder, named here, so that the command this process
    prints to resume it names its folder, whatever happens to the jobs."""
    values = overrides(argv)
    if not sweeping(argv) or "hydra.sweep.dir" in values:
        return argv
    root = values.get("results_root", "results")
    return [*argv, f"hydra.sweep.dir={root}/multirun/{time.strftime('%Y-%m-%d_%H-%M-%S')}"]


def stopped(message: str, argv: list[str]) -> None:
    print(f"evalkit: {message}\nevalkit: to resume: {resume_command(argv)}", file=sys.stderr)
    sys.exit(130)


def unfinished(err: Exception) -> bool:
    """A launcher's word that a job ended without a result: submitit's (a job killed, preempted, out of memory)."""
    kind = type(err)
    return kind.__module__.startswith("submitit.") and kind.__name__ in ("UncompletedJobError", "FailedJobError")


def main() -> None:
    argv = name_the_sweep(sys.argv[1:])
    # What escapes Hydra reaches the exit-code contract below, instead of Hydra's traceback and exit 1 (the gate's FAIL)
    os.environ["HYDRA_FULL_ERROR"] = "1"
    sys.argv[1:] = argv
    register_resolvers()
    stop = interrupt.Stop()  # the command's: asked by the first Ctrl-C while its jobs run
    prechecked = {}  # the parts the pre-check built, by job: handed to the jobs, never built again
    try:
        check_choices(argv)
        modes = {"-m", "--multirun", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion"} & set(argv)
        if len({m.lstrip("-")[0] for m in modes}) > 1:
            raise ConfigError(f"{' and '.join(sorted(modes))} cannot go together (Hydra runs one mode at a time)")
        if running(argv):  # --help, --cfg, ... are Hydra's to answer, with nothing of evalkit's loaded
            from evalkit.cli.precheck import precheck

            # Hydra's errors, unknown keys and bad values, as one line each, before Hydra runs; the parts built
            prechecked = precheck(argv)
        if not any(a in NOT_RUNNING for a in argv):
            check_writable(results_folder(argv))
    except ConfigError as err:
        fail(err)
    except KeyboardInterrupt:  # a Ctrl-C before any job began: 130 like any other, never a traceback and 1 (FAIL)
        stopped("stopped before the run began; no row was written", argv)
    except Exception:  # noqa: BLE001 - a bug before the model loads: exit 3 with the report line, never 1 (FAIL)
        sys.exit(internal(traceback.format_exc()))
    try:
        with stop.deferred():  # the first Ctrl-C lets every job finish the sample in flight
            run_jobs(stop, prechecked, sweep_size(argv) if sweeping(argv) else None)
    except JobError as err:
        fail(err)
    except InternalError as err:
        sys.exit(internal(str(err)))
    except Ended as ended:  # a sweep's gate (or a bug in its merge) has the last word
        sys.exit(ended.code)
    except interrupt.Interrupted as stop:
        stopped(str(stop), argv)
    except KeyboardInterrupt:
        if not stop.requested():
            raise
        # a second Ctrl-C, or one that reached a worker before it could defer it: rows are whole all the same
        stopped("stopped; every row written is whole", argv)
    except CompactHydraException as err:  # Hydra's own word on a config the pre-check let through
        fail(ConfigError(str(err).strip().splitlines()[0]))
    except Exception as err:  # noqa: BLE001 - what escaped Hydra's launcher: an unfinished job, or a bug (3, never 1)
        if unfinished(err):
            first = str(err).strip().splitlines()[0]
            print(
                f"evalkit: error: a sweep job did not finish ({first}; its log is beside it): the rows every job wrote "
                f"are kept\nevalkit: to resume: {resume_command(argv)}",
                file=sys.stderr,
            )
            sys.exit(EXIT_USAGE)
        sys.exit(internal(traceback.format_exc()))


if __name__ == "__main__":
    main()
