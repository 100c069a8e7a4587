"""Errors a user can fix, and the exit codes every evalkit command shares.

The contract (`python -m evalkit`, `evalkit.gate`, `evalkit.report`, `evalkit.lmeval`, sweeps):

    0    done, or the gate's PASS
    1    the gate's FAIL: the policy was judged and found worse than the thresholds allow
    2    bad input, or the gate cannot judge: one line naming the problem and the fix, no traceback
    3    an internal error (a bug in evalkit): the traceback is kept, with a line asking for a bug report
    130  interrupted (Ctrl-C); rows already written are whole, and the command to resume is printed
"""

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class ConfigError(ValueError):
    """Bad configuration or input, detected before (or instead of) a confusing failure deep in a library."""


class PolicyError(ConfigError):
    """A policy broke its contract at run time (kept more than its budget allows, returned duplicate or out-of-range
    indices, scored NaN) or raised inside its own code: exit 2, naming the policy, the layer and what it did. The
    fault is in the policy, never "a bug in evalkit"."""


class CannotJudge(ConfigError):
    """The gate cannot give a verdict on these records (duplicated or mixed rows, no policy rows, a baseline that
    cannot do the task, ...): exit 2, never a PASS, never confused with a FAIL."""


class JobError(BaseException):
    """A configuration error inside a run or a sweep's job. A BaseException, so that it ends a sweep (whatever the
    launcher, and across processes) with one clean line, instead of being recorded as one failed job and re-raised
    by Hydra with a traceback. Defined here, in an importable module, so that it unpickles as the same class in the
    launching process."""


class InternalError(BaseException):
    """An unexpected exception inside a run or a sweep's job, carried out of Hydra (which would report it with exit
    1, the gate's FAIL) as its formatted traceback, to end the command with exit 3."""
