"""Prefill once, compress many: per sample, one full-cache prefill of the context serves the baseline and every
policy variant, each decoding greedily on its own (shared or compressed) view of that cache.

A chunked variant instead prefills the context itself, `chunk` tokens at a time, compressing after each chunk, so
its cache never holds more than its budget plus one chunk: the full cache never exists.
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

from evalkit.attention import PrefillObserver, StepObserver, observe
from evalkit.cache import (
    compress,
    deployed_bytes,
    enforce,
    fp16_bytes,
    full_attention_layers,
    held_per_layer,
    kv_bytes,
    retained_fraction,
    share,
)
from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy, Need
from evalkit.prompt import Prompt
from evalkit.quantized import QuantSpec, attention_path, quantize_cache


@dataclass
class Variant:
    """A policy at a budget, optionally stored quantized, optionally prefilled in chunks; named as in records:
    `snapkv@0.25`, `none@1.0+int4`, `h2o@1024:chunk512`."""

    policy: KVPolicy
    quant: QuantSpec | None = None
    chunk: int | None = None  # prefill the context this many tokens at a time, compressing after each chunk

    @property
    def name(self) -> str:
        quant = f"+{self.quant.name}" if self.quant else ""
        return f"{self.policy.name}@{self.policy.budget}{quant}" + (f":chunk{self.chunk}" if self.chunk else "")

    def validate(self) -> None:
        """ConfigError for a combination that cannot run, whatever the context."""
        if self.quant is not None and self.policy.decode:
            raise ConfigError(
                f"{self.name}: evicting while decoding is not supported on quantized storage (tokens are "
                "packed in groups); set policy.decode=false or use quant=none"
            )
        if self.chunk is None:
            return
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ConfigError(f"prefill.chunk={self.chunk!r}: give a whole number of tokens such as 512")
        if not self.policy.chunkable:
            raise ConfigError(
                f"{self.name}: {self.policy.name} does not support a chunked prefill (it compresses once, "
                "after the whole prompt); use prefill=oneshot, or a policy that can evict chunk by chunk"
            )
        if self.quant is not None:
            raise ConfigError(f"{self.name}: a chunked prefill stores keys in full precision; drop +{self.quant.name}")
        window = self.policy.observation_window()
        if self.chunk < window:
            raise ConfigError(
                f"{self.name}: the chunk ({self.chunk} tokens) is shorter than {self.policy.name}'s observation "
                f"window ({window}); raise prefill.chunk or lower policy.window"
            )

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
    kv_bytes_deployed: int  # as a deployment holds them: dense in fp16/bf16, quantized packed (cache.deployed_bytes)
    kv_bytes_final: int  # held when decoding ended
    peak_kv_bytes: int  # the most held at any point: prefill, compression or decode
    prefill_peak_kv_bytes: int  # the most held while the context went through the model
    prefill_peak_tokens: int  # the most tokens an evicting layer held (per KV head) during the prefill
    tokens_held: list[int]  # per layer, right after compressing the context
    evidence_retained: list[float]  # per layer, fraction of the evidence tokens still held
    seconds: dict[str, float] = field(default_factory=dict)
    # how the quantized layers attended (evalkit.quantized): dense (none quantized), dequantized-cache (the CPU's copy),
    # packed-triton or packed-reference (the packed store, read by the Triton kernel or the PyTorch reference)
    attention_path: str = "dense"


@dataclass
class Held:
    """What a cache holds right after the context was compressed, before any decoding."""

    kv_bytes: int
    fp16: int
    deployed: int
    tokens: list[int]

    @classmethod
    def of(cls, cache: Cache) -> Held:
        return cls(kv_bytes(cache), fp16_bytes(cache), deployed_bytes(cache), held_per_layer(cache))


def outcome(
    name: str,
    held: Held,
    cache: Cache,
    dec: Decoded,
    prefill_peak: tuple[int, int],
    retained: list[float] = (),
    seconds: dict[str, float] | None = None,
) -> Outcome:
    """The Outcome of a decode (or teacher-forced pass) over `cache`, which held `held` before it began;
    `prefill_peak`: (bytes, tokens) at most while the context was prefilled."""
    return Outcome(
        name,
        dec.tokens,
        dec.logits,
        held.kv_bytes,
        held.fp16,
        held.deployed,
        kv_bytes(cache),
        max(dec.peak_bytes, held.kv_bytes, prefill_peak[0]),  # before every eviction: what really was held
        prefill_peak[0],
        prefill_peak[1],
        held.tokens,
        list(retained),
        dict(seconds or {}),
        attention_path(cache),
    )


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
        mass=Need.ATTN_MASS in needs, window=max((p.observation_window() for p in policies), default=0)
    )
    with observe(observer, cache) if needs else nullcontext():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, observer.observations


@torch.inference_mode()
def chunked_prefill(model: torch.nn.Module, ids: Tensor, policy: KVPolicy, chunk: int) -> tuple[Cache, int, int]:
    """Feed the context `chunk` tokens at a time; after each chunk the policy evicts down to its budget for the
    tokens seen so far. The first chunk is observed like a one-shot prefill; later chunks add their attention to
    H2O's running mass, and SnapKV scores with the last `window` queries of the latest chunk.

    Returns the cache, the most KV bytes it held (all layers) and the most tokens an evicting layer held per KV head,
    measured after every chunk's forward, before eviction: at most the budget plus one chunk.
    """
    cache: Cache = DynamicCache(config=model.config)
    window = policy.observation_window()
    peak_bytes = peak_tokens = 0
    for start in range(0, ids.shape[1], chunk):
        first = start == 0
        mass = Need.ATTN_MASS in policy.needs
        observer = PrefillObserver(mass=mass, window=window) if first else StepObserver(window)
        with observe(observer, cache):
            model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        peak_bytes = max(peak_bytes, kv_bytes(cache))
        held = held_per_layer(cache)
        peak_tokens = max(peak_tokens, *(held[i] for i in full_attention_layers(cache)))
        if first:
            cache = compress(cache, policy, observer.observations)
        else:
            enforce(cache, policy)
    return cache, peak_bytes, peak_tokens


@torch.inference_mode()
def greedy(
    model: torch.nn.Module,
    cache: Cache,
    ids: Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    after_forward: Callable[[], None] | None = None,
) -> Decoded:
    """Feed `ids` (the question) then decode greedily; `after_forward` runs after every forward (eviction).

    Evicting layers that keep a running attention mass (H2O) have it updated by every forward.
    """
    tokens, logits, peak = [], [], 0
    for _ in range(max_new_tokens):
        with observe(StepObserver(), cache):
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        peak = max(peak, kv_bytes(cache))  # before eviction: what the step really held
        if after_forward is not None:
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
    model: torch.nn.Module, cache: Cache, tokens: Tensor, after_forward: Callable[[], None] | None = None
) -> Decoded:
    """Feed `tokens` (1, M) one at a time, whatever the model would have said; logits[j] predicts tokens[j + 1].

    One token a step, so policies that evict while decoding do so exactly as they would while generating.
    """
    logits, peak = [], 0
    for j in range(tokens.shape[1] - 1):
        with observe(StepObserver(), cache):
            out = model(input_ids=tokens[:, j : j + 1], cache=cache, use_cache=True, logits_to_keep=1)
        peak = max(peak, kv_bytes(cache))
        if after_forward is not None:
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
    oneshot = [v.policy for v in variants if v.chunk is None]
    full, observations = prefill(model, context, oneshot)
    prefill_s = time.perf_counter() - t0
    full_bytes = kv_bytes(full)

    def run(name: str, cache: Cache, seconds: dict[str, float], after, prefill_peak: tuple[int, int]) -> Outcome:
        held = Held.of(cache)
        retained = retained_fraction(cache, prompt.evidence)
        t = time.perf_counter()
        if forced:
            dec = teacher_forced(model, cache, question, after)
        else:
            dec = greedy(model, cache, question, max_new_tokens, stop_ids, after)
        return outcome(name, held, cache, dec, prefill_peak, retained, {**seconds, "decode": time.perf_counter() - t})

    baseline = run(
        "baseline", share(full), {"prefill": prefill_s, "compress": 0.0}, None, (full_bytes, prompt.n_context)
    )
    outcomes = []
    for variant in variants:
        t = time.perf_counter()
        if variant.chunk is None:
            cache = variant.apply(full, observations)
            seconds = {"prefill": prefill_s, "compress": time.perf_counter() - t}
            peak = (full_bytes, prompt.n_context)
        else:
            cache, peak_bytes, peak_tokens = chunked_prefill(model, context, variant.policy, variant.chunk)
            seconds = {"prefill": time.perf_counter() - t, "compress": 0.0}  # compression runs inside the prefill
            peak = (peak_bytes, peak_tokens)
        policy = variant.policy
        after = (lambda c=cache, p=policy: enforce(c, p)) if policy.decode else None
        outcomes.append(run(variant.name, cache, seconds, after, peak))
    return baseline, outcomes
