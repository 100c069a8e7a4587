"""One writer per run folder: an OS-level lock (`fcntl.flock`) taken before evalkit writes anything there.

The lock is held on an open file, `RUN/.evalkit.lock`, which also says who holds it (pid, command, start time).
The operating system releases it when the holder exits, however it exits: a lock file left behind by a killed
process blocks nothing. A second run on the same folder stops at once, exit 2, naming the holder. The gate takes
the same lock to append its look (evalkit.records.looks), waiting a little for another gate, so looks taken at once
are numbered one after the other.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import sys
import time
from pathlib import Path

from evalkit.errors import ConfigError

LOCK = ".evalkit.lock"


class RunLock:
    """`with RunLock(folder):` holds the folder's lock for the block; ConfigError if another process holds it for
    longer than `wait` seconds."""

    def __init__(self, folder: Path, wait: float = 0.0):
        self.path = Path(folder) / LOCK
        self.wait = wait
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _take(fd, self.wait):
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent} is being written by another evalkit process ({holder}); wait for it to finish, "
                "or give this run another folder (hydra.run.dir=...)"
            ) from None
        os.ftruncate(fd, 0)
        info = {
            "pid": os.getpid(),
            "command": "python -m evalkit " + shlex.join(sys.argv[1:]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        os.write(fd, (json.dumps(info) + "\n").encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def _take(fd: int, wait: float) -> bool:
    """Take the lock on `fd`, trying again for up to `wait` seconds; False when another process still holds it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _read_holder(fd: int) -> str:
    """The holder's pid, command and start, in words, from the lock file (written right after it was taken)."""
    try:
        info = json.loads(os.pread(fd, 65536, 0).decode() or "{}")
        return f"pid {info['pid']}, started {info.get('started', '?')}: {info.get('command', '?')}"
    except (OSError, ValueError, KeyError, AttributeError):
        return "its pid not yet written"
