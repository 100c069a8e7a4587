"""Ctrl-C without losing work: the first SIGINT asks the run to stop once the sample in flight has its rows written;
a second one stops at once (rows are written whole, so even that loses at most the sample in flight).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

from evalkit import sigint

# Set by the evalkit command for its sweep's worker processes (joblib): they defer Ctrl-C from the moment they import
# this module, which they do while unpickling their job, before anything else of evalkit runs.
DEFER_ENV = "EVALKIT_DEFER_SIGINT"
# Set when a stop is asked, the only record of it: worker processes a sweep starts after the Ctrl-C (which they never
# received) inherit it.
STOP_ENV = "EVALKIT_STOP_REQUESTED"


class Interrupted(BaseException):
    """The run stopped early on request. A BaseException, like KeyboardInterrupt, so that it ends a Hydra sweep
    instead of being recorded as one failed job among many."""


def requested() -> bool:
    return bool(os.environ.get(STOP_ENV))


def _handler(signum, frame) -> None:
    sigint.record()
    if requested():
        raise KeyboardInterrupt
    os.environ[STOP_ENV] = "1"
    print("\nevalkit: stopping after the sample in flight (Ctrl-C again to stop now)", file=sys.stderr, flush=True)


def _raising(signum, frame) -> None:
    """Python's own Ctrl-C (KeyboardInterrupt at once), the SIGINT recorded: the user's stop, not a policy's raise."""
    sigint.record()
    raise KeyboardInterrupt


@contextmanager
def _sigint(handler):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def defer() -> None:
    """For the rest of this process (a sweep's worker), SIGINT sets `requested()` instead of raising."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _handler)


def deferred():
    """Within the block, SIGINT sets `requested()` instead of raising (in the main thread only)."""
    return _sigint(_handler)


def immediate():
    """Within the block, SIGINT raises KeyboardInterrupt at once: for work that cannot stop between samples."""
    return _sigint(_raising)


if os.environ.get(DEFER_ENV):
    defer()
