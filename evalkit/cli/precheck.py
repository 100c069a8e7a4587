"""Hydra's own errors as one-line ConfigErrors, before Hydra runs: the command line's overrides are parsed and the
config composed here, the way `@hydra.main` would, and every mistake (an unknown key, a malformed override, a value
of the wrong type, a mandatory value left unset) is named with its fix; then each job's parts are built, and so
checked (evalkit.cli.spec), and handed to the jobs that run them."""

from __future__ import annotations

from hydra import initialize_config_module

from evalkit.cli.spec import Parts, check, job_key
from evalkit.config.choices import searching, searchpath_of
from evalkit.config.overrides import RUNNING_FLAGS, check_resolved, compose_job, jobs, parse
from evalkit.errors import ConfigError


def precheck(argv: list[str]) -> dict[tuple[str, ...], Parts]:
    """Compose and check, before Hydra runs, the config of the job the command line asks for (of a sweep's jobs,
    those `jobs` lists): Hydra's errors, unknown keys and bad values become one-line ConfigErrors, before any model
    loads. The parts built, by job (job_key), for the jobs to run: none is built twice. Command lines with other
    flags than -m (--help, --cfg, -cn, ...) are left to Hydra (nothing built)."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    if flags - RUNNING_FLAGS:
        return {}
    sweep = bool(flags & {"-m", "--multirun"})
    parsed = parse([a for a in argv if not a.startswith("-")])

    built: dict[tuple[str, ...], Parts] = {}
    with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
        for job in jobs(parsed, sweep):
            try:
                cfg = compose_job(job)
                check_resolved(cfg)
                with searching(searchpath_of(job)):  # the user's config folders, as Hydra will search them
                    built[job_key(job)] = check(cfg)
            except ConfigError as err:
                if not sweep:
                    raise
                # named as a sweep's job names itself (evalkit.cli.main.HydraJob): its overrides, less Hydra's own
                named = [o for o in job if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
                raise ConfigError(f"[{' '.join(named)}] {err}") from None
    return built
