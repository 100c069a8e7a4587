"""How many jobs a sweep runs at once on this machine, and the torch threads each gets: the cores split between them
(`python -m evalkit -m hydra/launcher=joblib ...`), instead of every job taking all the cores and each running
several times slower than alone."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from hydra.errors import HydraException

from evalkit.config.overrides import parse
from evalkit.errors import ConfigError

JOBLIB = "JoblibLauncher"
SUBMITIT_LOCAL = "submitit_launcher.LocalLauncher"


def cores() -> int:
    """The cores this process may run on (its CPU affinity where the system says, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def sweep_size(overrides: list[str]) -> int | None:
    """The number of jobs a sweep's overrides make (the product of each swept key's values); None where it cannot be
    counted without the config (a glob, a range of reals) or the overrides do not parse (the pre-check says why)."""
    try:
        parsed = parse([o for o in overrides if not o.startswith("-")])
        counts = [len(list(o.sweep_string_iterator())) for o in parsed if o.is_sweep_override()]
    except (ConfigError, HydraException, ValueError, TypeError, AttributeError):
        return None
    return math.prod(counts)


def at_once(launcher: Mapping, jobs: int | None, n_cores: int) -> int | None:
    """How many of the sweep's `jobs` run at the same time on this machine under `launcher` (Hydra's launcher
    config): joblib's n_jobs (negative: cores + 1 + n_jobs, joblib's rule); every job for submitit's local executor,
    which starts them all (as many as the cores where the count is unknown); one for the basic launcher (jobs in turn,
    in this process). None for launchers whose jobs run elsewhere (Slurm, Ray), each on the cores its scheduler
    gives it."""
    target = str(launcher.get("_target_") or "")
    if JOBLIB in target:
        n = int(launcher.get("n_jobs") or -1)
        parallel = n if n > 0 else max(1, n_cores + 1 + n)
    elif SUBMITIT_LOCAL in target:
        parallel = jobs or n_cores
    elif target.endswith("BasicLauncher"):
        parallel = 1
    else:
        return None
    return max(1, min(parallel, jobs)) if jobs else parallel


def job_threads(launcher: Mapping, jobs: int | None, n_cores: int | None = None) -> int | None:
    """The torch threads of each job of a sweep: the cores divided by the jobs that run at once, at least 1, and no
    more than OMP_NUM_THREADS where the user set it; None where the launcher's jobs run on machines of their own."""
    n_cores = n_cores or cores()
    parallel = at_once(launcher, jobs, n_cores)
    if parallel is None:
        return None
    asked = os.environ.get("OMP_NUM_THREADS", "")
    share = max(1, n_cores // parallel)
    return min(share, int(asked)) if asked.isdigit() and int(asked) > 0 else share  # a user's own limit stands
