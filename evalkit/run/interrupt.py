"""Ctrl-C without losing work: the first SIGINT asks the run to stop once the sample in flight has its rows written;
a second one stops at once (rows are written whole, so even that loses at most the sample in flight).

The command line owns the stop request (a `Stop`): it installs its handler at start-up and passes it down to the run,
which reads it between samples. A process has one SIGINT handler, so a sweep's worker process keeps the `Stop` its
handler records to (`Stop.of_this_process`) for every job it runs.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from evalkit import sigint


class Interrupted(BaseException):
    """The run stopped early on request. A BaseException, like KeyboardInterrupt, so that it ends a Hydra sweep
    instead of being recorded as one failed job among many."""


class Stop:
    """A command's stop request: asked for by the first Ctrl-C (`deferred`, `defer`), honoured between samples."""

    def __init__(self, requested: bool = False) -> None:
        self._requested = requested

    def requested(self) -> bool:
        return self._requested

    def request(self) -> None:
        self._requested = True

    def _handler(self, signum, frame) -> None:
        sigint.record()
        if self._requested:
            raise KeyboardInterrupt
        self._requested = True
        print("\nevalkit: stopping after the sample in flight (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    def defer(self) -> None:
        """For the rest of this process (a sweep's worker), SIGINT asks this stop instead of raising."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handler)

    def deferred(self):
        """Within the block, SIGINT asks this stop instead of raising (in the main thread only)."""
        return _sigint(self._handler)

    @staticmethod
    def of_this_process() -> Stop | None:
        """The stop this process's SIGINT handler asks (one `defer` installed), if any."""
        owner = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
        return owner if isinstance(owner, Stop) else None


def _raising(signum, frame) -> None:
    """Python's own Ctrl-C (KeyboardInterrupt at once), the SIGINT recorded: the user's stop, not a policy's raise."""
    sigint.record()
    raise KeyboardInterrupt


@contextmanager
def _sigint(handler: Callable) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def immediate():
    """Within the block, SIGINT raises KeyboardInterrupt at once: for work that cannot stop between samples."""
    return _sigint(_raising)
