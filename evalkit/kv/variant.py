"""A variant: a policy at a budget, optionally stored quantized, optionally prefilled in chunks; what it refuses
whatever the context, and its cache over a prefilled full cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from transformers.cache_utils import Cache

from evalkit import contract
from evalkit.attention.observation import Observation
from evalkit.contract import KVPolicy
from evalkit.errors import ConfigError, ParamError
from evalkit.kv.cache import add_tokens, compress
from evalkit.kv.quantized import QuantSpec, quantize_cache
from evalkit.records.labels import variant_label


def policy_record(policy: KVPolicy) -> dict[str, Any]:
    """What a row records of the policy that ran: its class (import path) and every resolved setting, a wrapper's
    inner policy recorded the same way."""
    cls = type(policy)
    record = {"class": f"{cls.__module__}.{cls.__qualname__}", **dataclasses.asdict(policy)}
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if isinstance(value, KVPolicy):
            record[f.name] = policy_record(value)
    return record


@dataclass
class Variant:
    """A policy at a budget, optionally stored quantized, optionally prefilled in chunks; named as in records:
    `snapkv@0.25`, `none@1.0+int4`, `h2o@1024:chunk512`, the name derived from the policy's class and settings
    (evalkit.records.labels), never from a name typed in its config alone."""

    policy: KVPolicy
    quant: QuantSpec | None = None
    chunk: int | None = None  # prefill the context this many tokens at a time, compressing after each chunk

    @property
    def name(self) -> str:
        return variant_label(self.record(), self.quant_record(), self.chunk)

    def record(self) -> dict[str, Any]:
        return policy_record(self.policy)

    def quant_record(self) -> dict[str, Any] | None:
        return dataclasses.asdict(self.quant) if self.quant is not None else None

    def validate(self) -> None:
        """ConfigError for a combination that cannot run, whatever the context."""
        contract.check_declared(self.policy)
        contract.check_needs(self.policy)
        # asked of every policy, chunked or not: a user's policy whose declaration fails is told before any model loads
        with contract.calling(self.policy, "observation_window"):
            window = self.policy.observation_window()
        if self.quant is not None and self.policy.ragged:
            raise ConfigError(
                f"{self.name}: {self.policy.name} keeps a different number of tokens in each KV head, which quantized "
                "storage does not hold; use quant=none"
            )
        if self.quant is not None and self.policy.decode:
            raise ConfigError(
                f"{self.name}: evicting while decoding is not supported on quantized storage (tokens are "
                "packed in groups); set policy.decode=false or use quant=none"
            )
        if self.chunk is None:
            return
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ConfigError(f"prefill.chunk={self.chunk!r}: give a whole number of tokens such as 512")
        if self.policy.adds_tokens:
            raise ConfigError(
                f"{self.name}: {self.policy.name} adds tokens after the prompt once it is compressed in one pass, "
                "which a chunked prefill never is; use prefill=oneshot"
            )
        if not self.policy.chunkable:
            raise ConfigError(
                f"{self.name}: {self.policy.name} does not support a chunked prefill (it compresses once, "
                "after the whole prompt); use prefill=oneshot, or a policy that can evict chunk by chunk"
            )
        if self.quant is not None:
            raise ConfigError(f"{self.name}: a chunked prefill stores keys in full precision; drop +{self.quant.name}")
        if self.chunk < window:
            raise ConfigError(
                f"{self.name}: the chunk ({self.chunk} tokens) is shorter than {self.policy.name}'s observation "
                f"window ({window}); raise prefill.chunk or lower policy.window"
            )

    def check(self, n_context: int, where: str) -> None:
        """ConfigError, naming `where`, when the budget cannot hold on a context of n_context tokens."""
        try:
            with contract.calling(self.policy, "check_params"):
                contract.check_policy(self.policy, n_context)
            contract.check_fits(self.policy, n_context)
        except ParamError as err:  # the command line names the parameter as the user wrote the policy
            raise err.at(f"{where} ({n_context} context tokens), {self.name}") from None
        except ConfigError as err:
            raise ConfigError(f"{where} ({n_context} context tokens): {err}") from None

    def apply(self, full: Cache, observations: dict[int, dict[Observation, object]]) -> Cache:
        """The variant's cache over a prefilled full cache: the policy's choice and the tokens it adds, stored as
        `quant` says."""
        cache = compress(full, self.policy, observations)
        add_tokens(cache, self.policy)
        return quantize_cache(cache, self.quant) if self.quant is not None else cache
