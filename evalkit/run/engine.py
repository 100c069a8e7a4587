"""Prefill once, compress many: per sample, one full-cache prefill of the context serves the baseline and every
policy variant, each decoding greedily on its own (shared or compressed) view of that cache.

A chunked variant instead prefills the context itself, `chunk` tokens at a time, compressing after each chunk, so
its cache never holds more than its budget plus one chunk: the full cache never exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

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


def run_sample(
    model: torch.nn.Module,
    prompt: Prompt,
    variants: list[Variant],
    max_new_tokens: int,
    stop_ids: set[int],
    forced: bool = False,
    shared: dict | None = None,
) -> tuple[Outcome, list[Outcome]]:
    """The baseline and every variant on one prompt, from a single prefill of its context; their decodes run as one
    batch, and a variant that keeps the same tokens as another reuses its decode (evalkit.run.outcome.decode_jobs).

    `forced`: teacher-force the rest of the prompt (a continuation) instead of generating an answer.
    `shared`: a dict kept across prompts whose context ids are the same (several questions on one context): the
    first call stores its prefill and each variant's compressed cache there, later calls decode from copies of them
    instead of prefilling and compressing again (their rows say 0 seconds of prefill and compression).
    """
    ids = prompt.ids.to(model.device)
    context, question = ids[:, : prompt.n_context], ids[:, prompt.n_context :]
    if shared:
        return _rerun(model, prompt, variants, max_new_tokens, stop_ids, forced, shared, question)
    t0 = time.perf_counter()
    oneshot = [v.policy for v in variants if v.chunk is None]
    full, observations = prefill(model, context, oneshot)
    prefill_s = time.perf_counter() - t0
    rebuilt_s = reconstruction(model, full, context, prompt.repeat, oneshot, observations)  # KVzip's second pass
    full_peak = (kv_bytes(full), prompt.n_context)
    jobs = [Job("baseline", share(full), {"prefill": prefill_s, "compress": 0.0}, full_peak, shareable=True)]
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
        if shared is not None:  # later questions on this context decode from copies of this cache
            shared[variant.name] = (cache, peak)
            cache = share(cache)
        jobs.append(Job(variant.name, cache, seconds, peak, evictor(cache, variant.policy), shareable(variant)))
    if shared is not None:
        shared["baseline"] = (full, full_peak)
    outcomes = decode_jobs(model, jobs, question, max_new_tokens, stop_ids, forced, prompt.evidence)
    return outcomes[0], outcomes[1:]


def shareable(variant: Variant) -> bool:
    """Whether a variant's decode may be shared with another that keeps the same tokens: its cache is the plain
    gather of the prefill (no quantized storage, no chunked prefill) and never evicts while decoding."""
    return variant.quant is None and variant.chunk is None and not variant.policy.decode


def _rerun(
    model: torch.nn.Module,
    prompt: Prompt,
    variants: list[Variant],
    max_new_tokens: int,
    stop_ids: set[int],
    forced: bool,
    shared: dict,
    question: Tensor,
) -> tuple[Outcome, list[Outcome]]:
    """run_sample on a context already prefilled and compressed by an earlier call with the same `shared`: each
    variant (and the baseline) decodes this prompt's question from a copy of its stored cache, which stays as the
    compression left it, so every question sees the same compressed context. Caches grow by concatenation and
    evict by reassignment (cache.share), so a copy's decode never reaches the stored cache."""
    jobs = []
    for variant in [None, *variants]:
        name = "baseline" if variant is None else variant.name
        stored, peak = shared[name]
        cache = share(stored)
        after = evictor(cache, variant.policy) if variant is not None else None
        ok = variant is None or shareable(variant)
        jobs.append(Job(name, cache, {"prefill": 0.0, "compress": 0.0}, peak, after, ok))
    outcomes = decode_jobs(model, jobs, question, max_new_tokens, stop_ids, forced, prompt.evidence)
    return outcomes[0], outcomes[1:]


__all__ = [
    "Decoded",
    "Held",
    "Outcome",
    "Variant",
    "chunked_prefill",
    "evictor",
    "greedy",
    "outcome",
    "prefill",
    "reconstruct",
    "reconstruction",
    "run_sample",
    "teacher_forced",
]
