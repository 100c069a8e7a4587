"""Wrappers by composition that cannot drop a hook: every member of the policy contract, enumerated from KVPolicy
itself, that a wrapper does not change is its inner policy's.

The inner policy here overrides every member of the contract with an answer of its own (a method or property answers
("inner", its name); a class attribute is the opposite of KVPolicy's default), so a member the wrapper drops answers
what the base class does instead. Before, Wrapper forwarded 16 members by hand and none of asked, compresses, held,
over, ragged, ranks_across_layers, select, select_layers, wrappable: all 14 wrappers failed here (asked and
ranks_across_layers dropped by every one, select by per_layer, merging and key_rerotation, which ranked p's tokens by
KVPolicy's own select, never p's; compresses by all but dms and think, so compression_asked was KVPolicy's rule
whatever p says).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

from evalkit import policies
from evalkit.policies import KVPolicy, Wrapper

FIELDS = {f.name for f in dataclasses.fields(KVPolicy)}
MEMBERS = sorted(n for n in dir(KVPolicy) if not n.startswith("_") and n not in FIELDS)
# Every wrapper's own: it checks its own fields and budget, then its inner policy's settings (as inner.*).
OWN = {"validate", "check_params"}
# What KVPolicy builds from other members: a wrapper that changes one of those has its own (the base rule over its
# members), not the inner policy's: a wrapper that scores keeps by its own scores.
# A wrapper that chooses by its own rule (select, over) ranks layer by layer, whatever its inner policy would.
BUILT_FROM = {
    "select": {"score", "protected"},
    "over": {"select"},
    "select_layers": {"select", "over"},
    "ranks_across_layers": {"select", "over", "select_layers"},
    "target": {"min_tokens"},
    "keep_per_layer": {"target", "min_tokens"},
}


def marked(name: str):
    def member(self, *args, **kwargs):
        return ("inner", name)

    return member


def everything() -> type[KVPolicy]:
    """A policy overriding every member of the contract with an answer that is its own."""
    body = {}
    for name in MEMBERS:
        default = inspect.getattr_static(KVPolicy, name)
        if isinstance(default, property):
            body[name] = property(marked(name))
        elif callable(default):
            body[name] = marked(name)
        else:
            body[name] = (not default) if isinstance(default, bool) else ("inner", name)
    body["__annotations__"] = {"name": str}
    body["name"] = "everything"
    return dataclasses.dataclass(kw_only=True)(type("Everything", (KVPolicy,), body))


def wrappers() -> list[type[Wrapper]]:
    """Every wrapper evalkit ships: each subclass of Wrapper in evalkit.policies, whoever it extends."""
    for module in pkgutil.iter_modules(policies.__path__):
        importlib.import_module(f"evalkit.policies.{module.name}")
    found, todo = set(), [Wrapper]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("evalkit.policies."):
                found.add(sub)
    return sorted(found, key=lambda c: c.__name__)


def changes(cls: type[Wrapper]) -> set[str]:
    """The members a wrapper class changes: those it (or a wrapper class it extends) defines, and what the base class
    builds from them."""
    below = cls.__mro__[: cls.__mro__.index(Wrapper)]
    own = {name for name in MEMBERS for k in below if name in k.__dict__ and not rebuilt(k.__dict__[name], name)}
    while True:
        more = {name for name, sources in BUILT_FROM.items() if own & sources} - own
        if not more:
            return own | OWN
        own |= more


def rebuilt(value: object, name: str) -> bool:
    """Whether a wrapper class holds KVPolicy's own method: put there by the base rule (evalkit's DERIVED), not
    written by the wrapper, so that a wrong DERIVED shows here as a member dropped."""
    return callable(value) and value is KVPolicy.__dict__[name]


def answer(policy: KVPolicy, name: str) -> object:
    """What `policy` answers for a member: a method called with as many placeholders as KVPolicy's takes."""
    try:
        value = getattr(policy, name)
        default = inspect.getattr_static(KVPolicy, name)
        if callable(default) and not isinstance(default, property):
            n = len(inspect.signature(default).parameters) - 1
            return value(*[None] * n)
        return value
    except Exception as err:  # noqa: BLE001 - a dropped member may fail on placeholders: not the inner's answer
        return type(err).__name__


def test_every_wrapper_is_found():
    names = {cls.__name__ for cls in wrappers()}
    expected = {"AdaKV", "Block", "CaM", "Chunk", "ChunkKV", "CriticalKV", "CriticalAdaKV", "DMS"}
    expected |= {"EntropyGatedChunkKV", "KeyRerotation", "LUKV", "Merging", "PerLayer", "ThinK"}
    assert expected <= names


def test_the_contract_has_members_a_wrapper_leaves_alone():
    """The enumeration is KVPolicy's own: its hooks (score, select, select_layers, added, ...) and capabilities."""
    assert {"score", "select", "select_layers", "over", "compresses", "added", "chunkable", "needs"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", wrappers(), ids=lambda c: c.__name__)
def test_a_wrapper_is_its_inner_policy_in_every_member_it_does_not_change(cls):
    inner = everything()()
    wrapped = cls(inner=inner)
    kept = [name for name in MEMBERS if name not in changes(cls)]
    dropped = {
        name: (answer(wrapped, name), answer(wrapped.inner, name))
        for name in kept
        if answer(wrapped, name) != answer(wrapped.inner, name)
    }
    assert dropped == {}
    assert kept  # every wrapper leaves some member to its inner policy
