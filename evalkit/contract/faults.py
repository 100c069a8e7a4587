"""Whose fault an exception is: anything raised inside any method of a policy that is not evalkit's own (or a
wrapper over one) is the policy's, SystemExit and KeyboardInterrupt included, unless the user pressed Ctrl-C, which
the run layer, owning interrupts, tells (`guarding`). No process-wide state is read here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from evalkit.contract.policy import KVPolicy
from evalkit.errors import ConfigError, InternalError, JobError, PolicyError

OWN = "evalkit."  # evalkit's own policies live in evalkit.policies (policies/ installs there)


def users(policy: KVPolicy) -> KVPolicy | None:
    """The first policy in a chain of wrappers (adakv(chunkkv(mine))) that is not evalkit's own; None if all are."""
    while policy is not None:
        if not type(policy).__module__.startswith(OWN):
            return policy
        policy = getattr(policy, "inner", None)
    return None


def describe(policy: KVPolicy) -> str:
    cls = type(policy)
    return f"policy {policy.name} ({cls.__module__}.{cls.__qualname__})"


class PolicyInterrupt(KeyboardInterrupt):
    """A KeyboardInterrupt raised while a user's policy ran: still an interrupt (whatever handles Ctrl-C handles it),
    carrying the PolicyError it is if no SIGINT reached the process, i.e. if the policy raised it itself. The contract
    cannot tell which; the run layer, which owns interrupts, decides (`guarding`'s `interrupted`)."""

    def __init__(self, fault: PolicyError):
        super().__init__(str(fault))
        self.fault = fault


@contextmanager
def calling(policy: KVPolicy, method: str, layer_idx: int | None = None) -> Iterator[None]:
    """Run a call into a policy; whatever a user's policy raises there becomes a PolicyError naming the policy and
    its method (policy_fault), an interrupt a PolicyInterrupt. An evalkit policy's exception is evalkit's bug and
    passes through (exit 3)."""
    try:
        yield
    except PolicyInterrupt:  # named already, by the call it went through first
        raise
    except BaseException as err:  # noqa: BLE001 - whatever the user's code raises, SystemExit(0) included
        fault = policy_fault(err, [policy], method, layer_idx)
        if fault is None:
            raise
        if isinstance(err, KeyboardInterrupt):
            raise PolicyInterrupt(fault) from err
        raise fault from None


@contextmanager
def guarding(policies: list[KVPolicy], interrupted: Callable[[], bool]) -> Iterator[None]:
    """Around a whole run: what escapes it through the code of one of `policies` that is a user's (a method evalkit
    calls outside `calling`: observation_window, target, ...) is that policy's fault, as in `calling`. An interrupt
    is the user's stop when `interrupted()` (the run layer's word: a SIGINT reached the process), else the fault of
    the user's policy it went through."""
    try:
        yield
    except PolicyInterrupt as err:
        if interrupted():
            raise
        raise err.fault from None
    except BaseException as err:  # noqa: BLE001 - as in calling
        fault = None if isinstance(err, KeyboardInterrupt) and interrupted() else policy_fault(err, policies)
        if fault is None:
            raise
        raise fault from None


def policy_fault(
    err: BaseException, policies: list[KVPolicy], method: str | None = None, layer_idx: int | None = None
) -> PolicyError | None:
    """`err` as the fault of a user's policy among `policies`, naming it and the method of its own that raised (else
    `method`, the one evalkit called); None when it is not one: evalkit's own errors and stops, an evalkit policy's
    exception (evalkit's bug). Any exception of the user's code, SystemExit and KeyboardInterrupt are the policy's
    (it may not end or stop the run), unless the user pressed Ctrl-C: `guarding`'s caller tells."""
    if isinstance(err, (ConfigError, JobError, InternalError)):
        return None
    if not isinstance(err, (Exception, SystemExit, KeyboardInterrupt)):
        return None  # evalkit's own stops (a run interrupted on request) pass a policy's call untouched
    for owner in filter(None, map(users, policies)):
        name = own_method(err, owner) or method
        if name is not None:
            return PolicyError(blame(owner, name, layer_idx, err))
    return None


def own_method(err: BaseException, owner: KVPolicy) -> str | None:
    """The method of the user's policy the traceback of `err` went through first (score, where evalkit's select
    called it), or None when no code of the user's ran on the way (the fault is then in what it returned)."""
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_locals.get("self") is owner and not str(frame.f_globals.get("__name__", "")).startswith(OWN):
            return frame.f_code.co_name
        tb = tb.tb_next
    return None


def blame(owner: KVPolicy, method: str, layer_idx: int | None, err: BaseException) -> str:
    """One line: the user's policy raised `err` in `method`; the fault is the policy's."""
    where = f" at layer {layer_idx}" if layer_idx is not None else ""
    first = (str(err).strip().splitlines() or [""])[0][:200]
    if isinstance(err, SystemExit):
        first = f"exit code {err.code!r}: a policy may not end the run"
    elif isinstance(err, KeyboardInterrupt):
        first = "no Ctrl-C was pressed: a policy may not stop the run"
    return (
        f"{describe(owner)} raised {type(err).__name__} in {method}(){where}: {first}; the fault is in the policy's "
        "code: fix it (README, Write a policy)"
    )
