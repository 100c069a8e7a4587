"""A policy over another (Wrapper), as kvpress's wrappers hold a press object: by composition, with no hand list.

A wrapper changes what its class defines and delegates every other member of the contract (every public method,
property and class attribute of KVPolicy, enumerated from KVPolicy itself) to its inner policy, so that a new hook of
the contract reaches every wrapper without an edit here. A member the base class builds from others (`select` from
`score` and `protected`, `target` from `min_tokens`, ...: `DERIVED`) is the wrapper's own, by the base
rule, as soon as the wrapper changes one of those.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from evalkit.contract.policy import DERIVED, KVPolicy
from evalkit.errors import ConfigError, ParamError
from evalkit.fields import check_fields


def contract_members() -> frozenset[str]:
    """The members of the contract: KVPolicy's public methods, properties and class attributes, not its fields."""
    fields = {f.name for f in dataclasses.fields(KVPolicy)}
    return frozenset(n for n in dir(KVPolicy) if not n.startswith("_") and n not in fields)


class Delegated:
    """A member of the contract a wrapper does not change: its inner policy's (on the class: the contract's default)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, wrapper: Wrapper | None, owner: type | None = None):
        if wrapper is None:
            return getattr(KVPolicy, self.name)
        return getattr(wrapper.inner, self.name)


@dataclass(kw_only=True)
class Wrapper(KVPolicy):
    """A policy over another (`inner`): every member of the contract is the inner policy's unless the wrapper's class
    defines it (`delegated` names those that are the inner policy's). The inner policy takes the wrapper's budget and
    decode setting. Recorded as OUTER(INNER), e.g. chunkkv(snapkv)."""

    # the scorer: a KVPolicy object (evalkit.cli.config builds it from what a config gives: a conf/policy name, or a
    # mapping {name: snapkv, window: 16}), as kvpress's wrappers hold a press object
    inner: KVPolicy
    decode: bool | None = None  # None: the inner policy's default (snapkv: false, h2o: true)
    delegated: ClassVar[frozenset[str]] = frozenset()  # the members read from the inner policy (__init_subclass__)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        changed = {name for name in contract_members() if defines(cls, name)}
        grew = True
        while grew:  # a member built from one the wrapper changes is built by the base rule over the wrapper's own
            grew = False
            for name, sources in DERIVED.items():
                if name not in changed and changed & sources:
                    setattr(cls, name, KVPolicy.__dict__[name])
                    changed.add(name)
                    grew = True
        cls.delegated = contract_members() - changed

    def __post_init__(self) -> None:
        if not isinstance(self.inner, KVPolicy):
            raise ConfigError(
                f"{self.name}: inner={self.inner!r} is not a policy; give a KVPolicy object, or build the wrapper "
                "from its config (variants=[chunkkv(snapkv)@0.25], policy=chunkkv policy.inner=snapkv)"
            )
        if self.decode is None:
            self.decode = self.inner.decode
        # A copy: the inner policy holds the wrapper's budget and decode setting, whoever else holds the original.
        self.inner = dataclasses.replace(self.inner, budget=self.budget, decode=self.decode)
        if "(" not in self.name:
            self.name = f"{self.name}({self.inner.name})"

    def validate(self, shortest_context: int | None) -> None:
        """The wrapper's own fields and budget, then (check_params) its inner policy's."""
        super().validate(shortest_context)

    def check_params(self) -> None:
        if not self.inner.wrappable:
            raise ConfigError(f"{self.name}: {self.inner.name} keeps ragged heads and cannot be wrapped; wrap a scorer")
        try:
            check_fields(self.inner)
            self.inner.check_params()
        except ParamError as err:  # its keys are the wrapper's inner.*
            raise err.within("inner.") from None


def defines(cls: type, name: str) -> bool:
    """Whether a wrapper class (or a wrapper class it extends) defines `name` itself."""
    return any(name in k.__dict__ for k in cls.__mro__[: cls.__mro__.index(Wrapper)])


def delegate(wrapper: type[Wrapper]) -> None:
    """Make every member of the contract that Wrapper does not define its inner policy's, once, at import."""
    wrapper.delegated = contract_members() - set(wrapper.__dict__)
    for name in wrapper.delegated:
        setattr(wrapper, name, Delegated(name))


delegate(Wrapper)


@dataclass(kw_only=True)
class OnceWrapper(Wrapper):
    """A wrapper that compresses once, after the prompt, whatever its inner policy can (KeyRerotation, ThinK): neither
    chunk by chunk nor while decoding."""

    decode: bool | None = False
    chunkable: ClassVar[bool] = False
    decodable: ClassVar[bool] = False
