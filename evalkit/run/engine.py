"""Prefill once, compress many: per sample, one full-cache prefill of the context serves the baseline and every
policy variant, each decoding greedily on its own (shared or compressed) view of that cache.

A chunked variant instead prefills the context itself, `chunk` tokens at a time, compressing after each chunk, so
its cache never holds more than its budget plus one chunk: the full cache never exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache

from evalkit.kv.attention import PrefillObserver, StepObserver, observe, reconstruction_key
from evalkit.kv.cache import (
    compress,
    enforce,
    full_attention_layers,
    held_per_layer,
    kv_bytes,
    share,
)
from evalkit.kv.reconstruct import Block, hidden_norms, reconstruction_cache
from evalkit.kv.variant import Variant
from evalkit.policies import KVPolicy, Need, scorer
from evalkit.run.decode import Decoded, greedy, teacher_forced
from evalkit.run.outcome import Held, Job, Outcome, decode_jobs, outcome
from evalkit.tasks.prompt import Prompt, Repeat


@torch.inference_mode()
def prefill(
    model: torch.nn.Module, ids: Tensor, policies: list[KVPolicy] = ()
) -> tuple[Cache, dict[int, dict[str, Tensor]]]:
    """Run the context through the model with a full cache, observing once what any of `policies` needs.

    Returns the cache and, per full-attention layer, the observations (see evalkit.kv.attention).
    """
    cache = DynamicCache(config=model.config)
    needs = set().union(*(p.needs for p in policies))
    # Need.QUERY_STATS: from which position each policy counts the queries (a wrapper asks its inner policy)
    stats = sorted({scorer(p, "query_stats_from").query_stats_from() for p in policies if Need.QUERY_STATS in p.needs})
    observer = PrefillObserver(
        mass=Need.ATTN_MASS in needs,
        window=max((p.observation_window() for p in policies), default=0),
        query_stats=tuple(stats),
        rotary=getattr(getattr(model, "model", model), "rotary_emb", None) if stats else None,
    )
    with observe(observer, cache) if needs else nullcontext():
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, observer.observations


PREVIOUS_IDS = 8  # the ids of the previous chunk that a later chunk's repeat prompt quotes (kvpress: prev_postfix_size)


def pass_inputs(context: Tensor, repeat: Repeat, chunk: int) -> tuple[Tensor, Tensor, list[Block]]:
    """The ids (1, L) of every chunk's pass side by side, their positions (1, L) (each block from the context length
    on, where its own pass would start) and the blocks. The chunk [lo, hi) of the context after the template's opening
    (`repeat.start`) is read after `repeat.first` (the first chunk) or `repeat.part` and the previous chunk's last 8
    ids, then `repeat.suffix`."""
    n = context.shape[1]
    spans = [(lo, min(lo + chunk, n)) for lo in range(repeat.start, n, chunk)]
    ids, blocks, start = [], [], 0
    for i, (lo, hi) in enumerate(spans):
        quote = context[0, max(spans[i - 1][0], lo - PREVIOUS_IDS) : lo].tolist() if i else []
        head = (repeat.part + quote if i else repeat.first) + repeat.suffix
        ids.append(torch.cat([torch.tensor([head], dtype=context.dtype, device=context.device), context[:, lo:hi]], 1))
        blocks.append(Block(start, start + ids[-1].shape[1], lo, hi))
        start = blocks[-1].end
    if not ids:
        return context[:, :0], context[:, :0], []
    positions = torch.cat([torch.arange(n, n + b.end - b.start, device=context.device) for b in blocks])[None]
    return torch.cat(ids, dim=1), positions, blocks


@torch.inference_mode()
def reconstruct(
    model: torch.nn.Module,
    full: Cache,
    context: Tensor,
    repeat: Repeat,
    sinks: int,
    chunk: int,
    plus: bool = False,
) -> dict[int, Tensor]:
    """KVzip's second pass (policies/kvzip.py): per full-attention layer, (B, Hkv, n_context) the most attention each
    prefilled key receives while the model, over the full cache, reads the repeat prompt and then the context again,
    `chunk` context tokens per pass (the first `repeat.start` tokens, the template's opening, are not repeated and
    score 0); `plus`: KVzip+'s normalisation. Every chunk's pass is one block of a single forward
    (evalkit.kv.reconstruct), which reads `full` in place and leaves it unchanged."""
    ids, positions, blocks = pass_inputs(context, repeat, chunk)
    cache, scores = reconstruction_cache(full, blocks, sinks)
    if blocks:
        with hidden_norms(model, cache) if plus else nullcontext():
            model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
    return scores


def reconstruction_setting(policy: KVPolicy) -> tuple[int, int, bool]:
    """(sinks, chunk, KVzip+) of the reconstruction pass a policy that needs one scores with; a wrapper's
    (chunkkv(kvzip)) are its scorer's."""
    return scorer(policy, "reconstruction").reconstruction()


def reconstruction(
    model: torch.nn.Module,
    full: Cache,
    context: Tensor,
    repeat: Repeat | None,
    policies: list[KVPolicy],
    observations: dict[int, dict[str, Tensor]],
) -> dict[tuple[int, int, bool], float]:
    """Run `reconstruct` once per distinct (sinks, chunk, KVzip+) setting among the `policies` that need it (none:
    nothing runs), adding its scores to `observations`; returns the seconds each setting took."""
    seconds = {}
    for policy in policies:
        if Need.RECONSTRUCTION not in policy.needs:
            continue
        setting = reconstruction_setting(policy)
        if setting in seconds:
            continue
        t = time.perf_counter()
        for layer_idx, got in reconstruct(model, full, context, repeat or Repeat(), *setting).items():
            observations.setdefault(layer_idx, {})[reconstruction_key(*setting)] = got
        seconds[setting] = time.perf_counter() - t
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


def evictor(cache: Cache, policy: KVPolicy) -> Callable[[], None] | None:
    """What runs after every forward while decoding: None when the policy keeps the prompt's compression; else it
    evicts back to the budget after every `decode_interval`-th forward (the question's, then each generated token's),
    so the cache holds at most the budget plus decode_interval - 1 new tokens between evictions (kvpress's
    DecodingPress compresses every `compression_interval` steps the same way). The scorer ranks with the queries it
    keeps observed: its observation window, which slides with every forward (evalkit.kv.attention.StepObserver)."""
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
    seconds: dict[str, float]  # prefill, compress (and KVzip's reconstruct)
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
    run KVzip's reconstruction pass where a variant needs it; compress for each variant (a chunked variant prefills
    the context itself, chunk by chunk)."""
    t0 = time.perf_counter()
    oneshot = [v.policy for v in variants if v.chunk is None]
    full, observations = prefill(model, context, oneshot)
    prefill_s = time.perf_counter() - t0
    rebuilt_s = reconstruction(model, full, context, repeat, oneshot, observations)  # KVzip's second pass
    full_peak = (kv_bytes(full), context.shape[1])
    stored = [Stored("baseline", full, {"prefill": prefill_s, "compress": 0.0}, full_peak)]
    for variant in variants:
        t = time.perf_counter()
        if variant.chunk is None:
            cache = variant.apply(full, observations)
            seconds = {"prefill": prefill_s, "compress": time.perf_counter() - t}
            if Need.RECONSTRUCTION in variant.policy.needs:
                seconds["reconstruct"] = rebuilt_s[reconstruction_setting(variant.policy)]
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
    its decode (evalkit.run.outcome.decode_jobs). `evidence`: the context positions whose retention is recorded."""
    first = compressed.decodes == 0
    compressed.decodes += 1
    jobs = []
    for s in compressed.caches:
        cache = share(s.cache)
        seconds = s.seconds if first else {k: 0.0 for k in s.seconds}
        policy = s.variant.policy if s.variant is not None else None
        after = evictor(cache, policy) if policy is not None else None
        ok = s.variant is None or shareable(s.variant)
        jobs.append(Job(s.name, cache, dict(seconds), s.prefill_peak, after, ok))
    outcomes = decode_jobs(model, jobs, question, max_new_tokens, stop_ids, forced, list(evidence))
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
    "prefill",
    "reconstruct",
    "reconstruction",
    "run_sample",
    "teacher_forced",
]
