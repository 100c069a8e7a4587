"""Prefill once, compress many: per sample, one full-cache prefill of the context serves the baseline and every
policy variant, each decoding greedily on its own (shared or compressed) view of that cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache

from evalkit.attention import DecodeObserver, PrefillObserver, observe
from evalkit.cache import compress, enforce, fp16_bytes, held_per_layer, kv_bytes, retained_fraction, share
from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy
from evalkit.prompt import Prompt
from evalkit.quantized import QuantSpec, quantize_cache


@dataclass
class Variant:
    """A policy at a budget, optionally stored quantized; named as in records: `snapkv@0.25`, `none@1.0+int4`."""

    policy: KVPolicy
    quant: QuantSpec | None = None

    @property
    def name(self) -> str:
        return f"{self.policy.name}@{self.policy.budget}" + (f"+{self.quant.name}" if self.quant else "")

    def check(self, n_context: int, where: str) -> None:
        """ConfigError, naming `where`, when the budget cannot hold on a context of n_context tokens."""
        try:
            self.policy.validate(n_context)
        except ConfigError as err:
            raise ConfigError(f"{where} ({n_context} context tokens): {err}") from None

    def apply(self, full: Cache, observations: dict[int, dict[str, Tensor]]) -> Cache:
        """The variant's cache over a prefilled full cache: the policy's choice, stored as `quant` says."""
        cache = compress(full, self.policy, observations)
        return quantize_cache(cache, self.quant) if self.quant is not None else cache


@dataclass
class Decoded:
    tokens: list[int]
    logits: list[Tensor]  # (vocab,) float32 logits that chose each generated token
    peak_bytes: int  # largest KV bytes held at any point of the decode


@dataclass
class Outcome:
    """What one variant (or the baseline) did on one sample."""

    variant: str
    tokens: list[int]
    logits: list[Tensor]
    kv_bytes: int  # held right after compressing the context
    kv_bytes_fp16: int  # what the same held tokens would take as fp16 keys and values
    kv_bytes_final: int  # held when decoding ended
    peak_kv_bytes: int
    tokens_held: list[int]  # per layer, right after compressing the context
    evidence_retained: list[float]  # per layer, fraction of the evidence tokens still held
    seconds: dict[str, float] = field(default_factory=dict)


@torch.inference_mode()
def prefill(
    model: torch.nn.Module, ids: Tensor, policies: list[KVPolicy] = ()
) -> tuple[Cache, dict[int, dict[str, Tensor]]]:
    """Run the context through the model with a full cache, observing once what any of `policies` needs.

    Returns the cache and, per full-attention layer, the observations (see evalkit.attention).
    """
    cache = DynamicCache(config=model.config)
    needs = set().union(*(p.needs for p in policies))
    observer = PrefillObserver(
        mass="attn_mass" in needs,
        window=max((p.window for p in policies if "window_queries" in p.needs), default=0),
    )
    with observe(observer, cache) if needs else nullcontext():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, observer.observations


@torch.inference_mode()
def greedy(
    model: torch.nn.Module,
    cache: Cache,
    ids: Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    after_forward: Callable[[], None] = lambda: None,
) -> Decoded:
    """Feed `ids` (the question) then decode greedily; `after_forward` runs after every forward (eviction).

    Evicting layers that keep a running attention mass (H2O) have it updated by every forward.
    """
    tokens, logits, peak = [], [], 0
    for _ in range(max_new_tokens):
        with observe(DecodeObserver(), cache):
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        peak = max(peak, kv_bytes(cache))  # before eviction: what the step really held
        after_forward()
        step = out.logits[0, -1].float()
        token = int(step.argmax())
        tokens.append(token)
        logits.append(step)
        if token in stop_ids:
            break
        ids = torch.tensor([[token]], device=ids.device)
    return Decoded(tokens, logits, peak)


@torch.inference_mode()
def teacher_forced(
    model: torch.nn.Module, cache: Cache, tokens: Tensor, after_forward: Callable[[], None] = lambda: None
) -> Decoded:
    """Feed `tokens` (1, M) one at a time, whatever the model would have said; logits[j] predicts tokens[j + 1].

    One token a step, so policies that evict while decoding do so exactly as they would while generating.
    """
    logits, peak = [], 0
    for j in range(tokens.shape[1] - 1):
        with observe(DecodeObserver(), cache):
            out = model(input_ids=tokens[:, j : j + 1], cache=cache, use_cache=True, logits_to_keep=1)
        peak = max(peak, kv_bytes(cache))
        after_forward()
        logits.append(out.logits[0, -1].float())
    return Decoded([], logits, peak)


def run_sample(
    model: torch.nn.Module,
    prompt: Prompt,
    variants: list[Variant],
    max_new_tokens: int,
    stop_ids: set[int],
    forced: bool = False,
) -> tuple[Outcome, list[Outcome]]:
    """The baseline and every variant on one prompt, from a single prefill of its context.

    `forced`: teacher-force the rest of the prompt (a continuation) instead of generating an answer.
    """
    ids = prompt.ids.to(model.device)
    context, question = ids[:, : prompt.n_context], ids[:, prompt.n_context :]
    t0 = time.perf_counter()
    full, observations = prefill(model, context, [v.policy for v in variants])
    prefill_s = time.perf_counter() - t0

    def run(name: str, cache: Cache, compress_s: float, after: Callable[[], None]) -> Outcome:
        held, held_layers, fp16 = kv_bytes(cache), held_per_layer(cache), fp16_bytes(cache)
        retained = retained_fraction(cache, prompt.evidence)
        t = time.perf_counter()
        if forced:
            dec = teacher_forced(model, cache, question, after)
        else:
            dec = greedy(model, cache, question, max_new_tokens, stop_ids, after)
        seconds = {"prefill": prefill_s, "compress": compress_s, "decode": time.perf_counter() - t}
        return Outcome(
            name,
            dec.tokens,
            dec.logits,
            held,
            fp16,
            kv_bytes(cache),
            max(dec.peak_bytes, held),
            held_layers,
            retained,
            seconds,
        )

    baseline = run("baseline", share(full), 0.0, lambda: None)
    outcomes = []
    for variant in variants:
        t = time.perf_counter()
        cache = variant.apply(full, observations)
        compress_s = time.perf_counter() - t
        policy = variant.policy
        after = (lambda c=cache, p=policy: enforce(c, p)) if policy.decode else (lambda: None)
        outcomes.append(run(variant.name, cache, compress_s, after))
    return baseline, outcomes
