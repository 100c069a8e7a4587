"""Whether this process has received a SIGINT: the user's Ctrl-C, told apart from a KeyboardInterrupt that code
raised itself (a user's policy may raise one; that is its fault, exit 2, not the user's stop, exit 130).

evalkit.run.interrupt's handlers record each SIGINT here; the policy contract (evalkit.kv.contract) reads it.
"""

from __future__ import annotations

_received = 0


def record() -> None:
    """Note one SIGINT received by this process."""
    global _received
    _received += 1


def received() -> bool:
    """Whether a SIGINT has reached this process since it started."""
    return _received > 0
