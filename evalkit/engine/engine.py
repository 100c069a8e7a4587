"""Prefill once, compress many: per sample, one full-cache prefill of the context serves the baseline and every
policy variant, each decoding greedily on its own (shared or compressed) view of that cache.

A chunked variant instead prefills the context itself, `chunk` tokens at a time, compressing after each chunk, so
its cache never holds more than its budget plus one chunk: the full cache never exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache

from evalkit.attention.observation import Observation, PrefillRecorder, StepRecorder
from evalkit.attention.sdpa import observe
from evalkit.engine.decode import Decoded, greedy, teacher_forced
from evalkit.engine.outcome import Held, Outcome, VariantDecode, decode_variants, outcome
from evalkit.kv.cache import (
    compress,
    enforce,
    full_attention_layers,
    held_per_layer,
    kv_bytes,
    share,
)
from evalkit.kv.variant import Variant
from evalkit.policies import KVPolicy
from evalkit.tasks.prompt import Prompt, Repeat


def needed(policies: list[KVPolicy]) -> tuple[Observation, ...]:
    """The observations any of `policies` needs, each once (equal observations of several variants are one)."""
    return tuple(dict.fromkeys(o for p in policies for o in p.needs()))


@torch.inference_mode()
def prefill(
    model: torch.nn.Module, ids: Tensor, policies: list[KVPolicy] = ()
) -> tuple[Cache, dict[int, dict[Observation, object]]]:
    """Run the context through the model with a full cache, recording once what any of `policies` needs.

    Returns the cache and, per full-attention layer, the observations (see evalkit.attention.observation).
    """
    cache = DynamicCache(config=model.config)
    needs = needed(policies)
    recorder = PrefillRecorder(needs, model)
    watch = observe(recorder, cache) if needs else {}
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **watch)
    return cache, recorder.observations


def reconstruction(
    model: torch.nn.Module,
    full: Cache,
    context: Tensor,
    repeat: Repeat | None,
    policies: list[KVPolicy],
    observations: dict[int, dict[Observation, object]],
) -> dict[Observation, float]:
    """Run the second pass of every observation among the `policies`' needs that has one (KVzip's reconstruction),
    each distinct one once, over the prefilled `full` cache, adding its values to `observations`; returns the
    seconds each took. `repeat`: the task's repeat prompt, which the pass reads (None: a prompt of raw ids)."""
    seconds = {}
    for obs in needed(policies):
        if obs.pass_name is None:
            continue
        t = time.perf_counter()
        with torch.inference_mode():
            for layer_idx, got in obs.second_pass(model, full, context, repeat).items():
                observations.setdefault(layer_idx, {})[obs] = got
        seconds[obs] = time.perf_counter() - t
    return seconds


@torch.inference_mode()
def chunked_prefill(model: torch.nn.Module, ids: Tensor, policy: KVPolicy, chunk: int) -> tuple[Cache, int, int]:
    """Feed the context `chunk` tokens at a time; after each chunk the policy evicts down to its budget for the
    tokens seen so far. The first chunk is observed like a one-shot prefill; later chunks add their attention to
    H2O's running mass, and SnapKV scores with the last `window` queries of the latest chunk.

    Returns the cache, the most KV bytes it held (all layers) and the most tokens an evicting layer held per KV head,
    measured after every chunk's forward, before eviction: at most the budget plus one chunk.
    """
    cache: Cache = DynamicCache(config=model.config)
    peak_bytes = peak_tokens = 0
    for start in range(0, ids.shape[1], chunk):
        first = start == 0
        recorder = PrefillRecorder(tuple(policy.needs()), model) if first else StepRecorder()
        watch = observe(recorder, cache)
        model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1, **watch)
        peak_bytes = max(peak_bytes, kv_bytes(cache))
        held = held_per_layer(cache)
        peak_tokens = max(peak_tokens, *(held[i] for i in full_attention_layers(cache)))
        if first:
            cache = compress(cache, policy, recorder.observations)
        else:
            enforce(cache, policy)
    return cache, peak_bytes, peak_tokens


def evictor(cache: Cache, policy: KVPolicy) -> Callable[[], None] | None:
    """What runs after every forward while decoding: None when the policy keeps the prompt's compression; else it
    evicts back to the budget after every `decode_interval`-th forward (the question's, then each generated token's),
    so the cache holds at most the budget plus decode_interval - 1 new tokens between evictions (kvpress's
    DecodingPress compresses every `compression_interval` steps the same way). The scorer ranks with the queries it
    keeps observed: its observation window, which slides with every forward (evalkit.attention.observation)."""
    if not policy.decode:
        return None
    forwards = 0

    def after() -> None:
        nonlocal forwards
        forwards += 1
        if forwards % policy.decode_interval == 0:
            enforce(cache, policy)

    return after


@dataclass
class Stored:
    """One cache of a compressed context, as compression left it, with what its rows record of how it was made."""

    name: str  # "baseline" or the variant's name
    cache: Cache
    seconds: dict[str, float]  # prefill, compress (and each second pass by its name: KVzip's reconstruct)
    prefill_peak: tuple[int, int]  # (bytes, tokens of an evicting layer per KV head) at most while prefilling
    variant: Variant | None = None  # None: the baseline's full cache


@dataclass
class Compressed:
    """A context prefilled once and compressed by every variant: compress once, decode as many questions as asked.
    Every decode works on copies (cache.share: caches grow by concatenation and evict by reassignment), so each
    question sees the context as compression left it. The first decode's rows carry the prefill and compression
    seconds; later ones 0, the work being done."""

    caches: list[Stored]  # the baseline's first
    decodes: int = 0


def compress_context(
    model: torch.nn.Module, context: Tensor, variants: list[Variant], repeat: Repeat | None = None
) -> Compressed:
    """Prefill `context` (1, n) once with a full cache (the baseline's), observing what the one-shot variants need;
    run the second passes they need (KVzip's reconstruction); compress for each variant (a chunked variant prefills
    the context itself, chunk by chunk)."""
    t0 = time.perf_counter()
    oneshot = [v.policy for v in variants if v.chunk is None]
    full, observations = prefill(model, context, oneshot)
    prefill_s = time.perf_counter() - t0
    passes = reconstruction(model, full, context, repeat, oneshot, observations)  # KVzip's second pass
    full_peak = (kv_bytes(full), context.shape[1])
    stored = [Stored("baseline", full, {"prefill": prefill_s, "compress": 0.0}, full_peak)]
    for variant in variants:
        t = time.perf_counter()
        if variant.chunk is None:
            cache = variant.apply(full, observations)
            seconds = {"prefill": prefill_s, "compress": time.perf_counter() - t}
            seconds |= {o.pass_name: passes[o] for o in variant.policy.needs() if o in passes}
            peak = full_peak
        else:
            cache, peak_bytes, peak_tokens = chunked_prefill(model, context, variant.policy, variant.chunk)
            seconds = {"prefill": time.perf_counter() - t, "compress": 0.0}  # compression runs inside the prefill
            peak = (peak_bytes, peak_tokens)
        stored.append(Stored(variant.name, cache, seconds, peak, variant))
    return Compressed(stored)


def decode(
    model: torch.nn.Module,
    compressed: Compressed,
    question: Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    forced: bool = False,
    evidence: list[int] = (),
) -> tuple[Outcome, list[Outcome]]:
    """The baseline's and every variant's Outcome for one question (1, q) after the compressed context: each decodes
    from a copy of its cache (greedy; or teacher-forced when `forced`), a policy that evicts while decoding doing so
    after every forward. The decodes run as one batch, and a variant that keeps the same tokens as another reuses
    its decode (evalkit.engine.outcome.decode_variants). `evidence`: the context positions whose retention is
    recorded."""
    first = compressed.decodes == 0
    compressed.decodes += 1
    jobs = []
    for s in compressed.caches:
        cache = share(s.cache)
        seconds = s.seconds if first else {k: 0.0 for k in s.seconds}
        policy = s.variant.policy if s.variant is not None else None
        after = evictor(cache, policy) if policy is not None else None
        ok = s.variant is None or shareable(s.variant)
        jobs.append(VariantDecode(s.name, cache, dict(seconds), s.prefill_peak, after, ok))
    outcomes = decode_variants(model, jobs, question, max_new_tokens, stop_ids, forced, list(evidence))
    return outcomes[0], outcomes[1:]


def run_sample(
    model: torch.nn.Module,
    prompt: Prompt,
    variants: list[Variant],
    max_new_tokens: int,
    stop_ids: set[int],
    forced: bool = False,
) -> tuple[Outcome, list[Outcome]]:
    """The baseline and every variant on one prompt, from a single prefill of its context (compress_context, then
    decode). `forced`: teacher-force the rest of the prompt (a continuation) instead of generating an answer."""
    ids = prompt.ids.to(model.device)
    compressed = compress_context(model, ids[:, : prompt.n_context], variants, prompt.repeat)
    return decode(model, compressed, ids[:, prompt.n_context :], max_new_tokens, stop_ids, forced, prompt.evidence)


def shareable(variant: Variant) -> bool:
    """Whether a variant's decode may be shared with another that keeps the same tokens: its cache is the plain
    gather of the prefill (no quantized storage, no chunked prefill) and never evicts while decoding."""
    return variant.quant is None and variant.chunk is None and not variant.policy.decode


__all__ = [
    "Compressed",
    "Decoded",
    "Held",
    "Outcome",
    "Variant",
    "chunked_prefill",
    "compress_context",
    "decode",
    "evictor",
    "greedy",
    "outcome",
    "needed",
    "prefill",
    "reconstruction",
    "run_sample",
    "teacher_forced",
]
