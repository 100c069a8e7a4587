"""Errors a user can fix, and the exit codes every evalkit command shares.

The contract (`python -m evalkit`, `evalkit.gate`, `evalkit.report`, `evalkit.lmeval`, sweeps):

    0    done, or the gate's PASS
    1    the gate's FAIL: the policy was judged and found worse than the thresholds allow
    2    bad input, or the gate cannot judge: one line naming the problem and the fix, no traceback
    3    an internal error (a bug in evalkit): the traceback is kept, with a line asking for a bug report
    130  interrupted (Ctrl-C); rows already written are whole, and the command to resume is printed
"""

from __future__ import annotations

from pathlib import PurePath
from string import Template
from typing import Any

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


class ParamError(ConfigError):
    """A parameter of a policy (or of a task, a backend) out of its range, named by its key relative to the object
    that holds it (`window`, `budget`; `inner.window` once a wrapper adds `inner.`), never by the command line's key:
    the command line adds `policy.` (or names the variant), as it alone knows how the user wrote the policy.

    `values`: the keys at fault and their values, in the order the message shows them; `problem`: the text that
    follows them, from its first character (`: give a chunk such as 256`, ` is negative; give 0.0`), in which `$key`
    stands for another key of the same object, prefixed as the ones shown (`give e.g. $window=32`). The message is
    composed from these; `within` and `at` return the same error under a key prefix or after a place. `unset`: a
    required key left unset, which the problem names (`kvzap needs its surrogate models: give $weights_path=DIR`)."""

    def __init__(self, values: dict[str, Any], problem: str, prefix: str = "", place: str = "", unset: bool = False):
        self.values, self.problem, self.prefix, self.place, self.unset = dict(values), problem, prefix, place, unset
        shown = "" if unset else ", ".join(f"{prefix}{key}={written(value)}" for key, value in self.values.items())
        body = shown + Template(problem).safe_substitute(_Keys(prefix))
        super().__init__(f"{place}: {body}" if place else body)

    @property
    def key(self) -> str:
        """The first key at fault, with its prefix: `window`, `inner.window`, `policy.inner.window`."""
        return self.prefix + next(iter(self.values))

    def within(self, prefix: str) -> ParamError:
        """The same error with every key under `prefix` (`inner.`, `policy.`)."""
        return ParamError(self.values, self.problem, prefix + self.prefix, self.place, self.unset)

    def at(self, place: str) -> ParamError:
        """The same error after `place` (`variants: snapkv@0.25`, `sample 'a' (40 context tokens)`)."""
        where = f"{place}: {self.place}" if self.place else place
        return ParamError(self.values, self.problem, self.prefix, where, self.unset)

    def __reduce__(self):  # pickled across a sweep's worker processes, as it was built
        return ParamError, (self.values, self.problem, self.prefix, self.place, self.unset)


class _Keys(dict):
    """`$key` in a ParamError's problem -> the key under the error's prefix."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def __missing__(self, key: str) -> str:
        return self.prefix + key


def written(value: Any, quoted: bool = True) -> str:
    """A value as the command line writes it: true, null, [0.25,0.5], 'avg' (a string or a path quoted, so that ''
    shows; `quoted=False`: as typed, avg)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(written(v, quoted) for v in value) + "]"
    return repr(str(value)) if quoted and isinstance(value, (str, PurePath)) else str(value)
