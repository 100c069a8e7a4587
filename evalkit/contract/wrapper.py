"""A policy over another (Wrapper), as kvpress's wrappers hold a press object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from evalkit.attention.observation import Observation
from evalkit.contract.policy import KVPolicy
from evalkit.contract.view import LayerView, Probes
from evalkit.errors import ConfigError
from evalkit.fields import check_fields


@dataclass(kw_only=True)
class Wrapper(KVPolicy):
    """A policy over another (`inner`): what it needs observed, its window, protected tokens, per-layer budgets and
    whether it can evict chunk by chunk or while decoding are the inner policy's, unless the wrapper says otherwise.
    The inner policy takes the wrapper's budget and decode setting. Recorded as OUTER(INNER), e.g. chunkkv(snapkv)."""

    # the scorer: a KVPolicy object (evalkit.cli.config builds it from what a config gives: a conf/policy name, or a
    # mapping {name: snapkv, window: 16}), as kvpress's wrappers hold a press object
    inner: KVPolicy
    decode: bool | None = None  # None: the inner policy's default (snapkv: false, h2o: true)

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

    def needs(self) -> tuple[Observation, ...]:
        return self.inner.needs()

    @property
    def chunkable(self) -> bool:  # type: ignore[override]
        return self.inner.chunkable

    @property
    def decodable(self) -> bool:  # type: ignore[override]
        return self.inner.decodable

    @property
    def budget_counts_tokens(self) -> bool:  # type: ignore[override]
        return self.inner.budget_counts_tokens

    @property
    def reads_question(self) -> bool:  # type: ignore[override]
        return self.inner.reads_question

    def observation_window(self) -> int:
        return self.inner.observation_window()

    def prepare(self, model, probes: Probes) -> dict | None:
        return self.inner.prepare(model, probes)

    def protected(self, view: LayerView, k: int) -> Tensor | None:
        return self.inner.protected(view, k)

    def min_tokens(self) -> int:
        return self.inner.min_tokens()

    def target(self, seen: int) -> int:
        return self.inner.target(seen)

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        return self.inner.keep_per_layer(seen, n_layers)

    def score(self, view: LayerView) -> Tensor:
        return self.inner.score(view)

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor] | None:
        return self.inner.rewrite(view, kept)

    def added(self, view: LayerView) -> tuple[Tensor, Tensor] | None:
        return self.inner.added(view)

    def continues_from_held(self) -> bool:
        return self.inner.continues_from_held()

    def check_params(self) -> None:
        check_fields(self.inner, "policy.inner")
        if not self.inner.wrappable:
            raise ConfigError(f"{self.name}: {self.inner.name} keeps ragged heads and cannot be wrapped; wrap a scorer")
        try:
            self.inner.check_params()
        except ConfigError as err:  # its keys are the wrapper's policy.inner.*
            raise ConfigError(str(err).replace("policy.", "policy.inner.")) from None


@dataclass(kw_only=True)
class OnceWrapper(Wrapper):
    """A wrapper that compresses once, after the prompt, whatever its inner policy can (KeyRerotation, ThinK): neither
    chunk by chunk nor while decoding."""

    decode: bool | None = False

    @property
    def chunkable(self) -> bool:  # type: ignore[override]
        return False

    @property
    def decodable(self) -> bool:  # type: ignore[override]
        return False
