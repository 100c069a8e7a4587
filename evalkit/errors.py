"""Errors a user can fix. The CLI prints their message on one line and exits with code 2."""


class ConfigError(ValueError):
    """Bad configuration or input, detected before (or instead of) a confusing failure deep in a library."""


class JobError(BaseException):
    """A configuration error inside a run or a sweep's job. A BaseException, so that it ends a sweep (whatever the
    launcher, and across processes) with one clean line, instead of being recorded as one failed job and re-raised
    by Hydra with a traceback. Defined here, in an importable module, so that it unpickles as the same class in the
    launching process."""
