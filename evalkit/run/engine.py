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

from evalkit.kv.attention import PrefillObserver, ReconstructionObserver, StepObserver, observe, reconstruction_key
from evalkit.kv.cache import (
    allocated_per_layer,
    allowed_per_layer,
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
from evalkit.kv.quantized import attention_path
from evalkit.kv.variant import Variant
from evalkit.policies import KVPolicy, Need, scorer
from evalkit.tasks.prompt import Prompt, Repeat


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
    tokens_held: list[int | float]  # per layer and KV head (a ragged layer: the mean), right after compression
    evidence_retained: list[float]  # per layer, fraction of the evidence tokens still held
    seconds: dict[str, float] = field(default_factory=dict)
    # how the quantized layers attended (evalkit.quantized): dense (none quantized), dequantized-cache (the CPU's copy),
    # packed-triton or packed-reference (the packed store, read by the Triton kernel or the PyTorch reference)
    attention_path: str = "dense"
    tokens_allocated: list[int] = field(default_factory=list)  # per layer, slots per KV head (ragged: the longest)
    # per layer, the tokens per KV head the policy contract allowed (budget + declared protected; evalkit.contract)
    tokens_allowed: list[int | float] = field(default_factory=list)


@dataclass
class Held:
    """What a cache holds right after the context was compressed, before any decoding."""

    kv_bytes: int
    fp16: int
    deployed: int
    tokens: list[int | float]
    allocated: list[int]
    allowed: list[int | float]

    @classmethod
    def of(cls, cache: Cache) -> Held:
        return cls(
            kv_bytes(cache),
            fp16_bytes(cache),
            deployed_bytes(cache),
            held_per_layer(cache),
            allocated_per_layer(cache),
            allowed_per_layer(cache),
        )


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
        held.allocated,
        held.allowed,
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


@torch.inference_mode()
def reconstruct(
    model: torch.nn.Module, full: Cache, context: Tensor, repeat: Repeat, sinks: int, chunk: int
) -> dict[int, Tensor]:
    """KVzip's second pass (policies/kvzip.py): per full-attention layer, (B, Hkv, n_context) the most attention
    each prefilled key receives while the model, over the full cache, reads the repeat prompt and then the context
    again, `chunk` context tokens per pass (the first `repeat.start` tokens, the template's opening, are not
    repeated and score 0). Each pass runs on its own `share` of `full`, which stays unchanged."""
    n = context.shape[1]
    scores = {
        i: torch.zeros(context.shape[0], full.layers[i].keys.shape[1], n, device=context.device)
        for i in full_attention_layers(full)
    }
    spans = [(lo, min(lo + chunk, n)) for lo in range(repeat.start, n, chunk)]
    for i, (lo, hi) in enumerate(spans):
        quote = context[0, max(spans[i - 1][0], lo - PREVIOUS_IDS) : lo].tolist() if i else []
        head = (repeat.part + quote if i else repeat.first) + repeat.suffix
        ids = torch.cat([torch.tensor([head], dtype=context.dtype, device=context.device), context[:, lo:hi]], 1)
        cache = share(full)
        with observe(ReconstructionObserver(min(sinks, lo), lo, hi, scores), cache):
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return scores


def reconstruction_setting(policy: KVPolicy) -> tuple[int, int]:
    """(sinks, chunk) of the reconstruction pass a policy that needs one scores with; a wrapper's (chunkkv(kvzip))
    are its scorer's."""
    return scorer(policy, "reconstruction").reconstruction()


def reconstruction(
    model: torch.nn.Module,
    full: Cache,
    context: Tensor,
    repeat: Repeat | None,
    policies: list[KVPolicy],
    observations: dict[int, dict[str, Tensor]],
) -> dict[tuple[int, int], float]:
    """Run `reconstruct` once per distinct (sinks, chunk) setting among the `policies` that need it (none: nothing
    runs), adding its scores to `observations`; returns the seconds each setting took."""
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
    keeps observed: its observation window, which slides with every forward (evalkit.attention.StepObserver)."""
    if not policy.decode:
        return None
    forwards = 0

    def after() -> None:
        nonlocal forwards
        forwards += 1
        if forwards % policy.decode_interval == 0:
            enforce(cache, policy)

    return after


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
    shared: dict | None = None,
) -> tuple[Outcome, list[Outcome]]:
    """The baseline and every variant on one prompt, from a single prefill of its context.

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
            if Need.RECONSTRUCTION in variant.policy.needs:
                seconds["reconstruct"] = rebuilt_s[reconstruction_setting(variant.policy)]
            peak = (full_bytes, prompt.n_context)
        else:
            cache, peak_bytes, peak_tokens = chunked_prefill(model, context, variant.policy, variant.chunk)
            seconds = {"prefill": time.perf_counter() - t, "compress": 0.0}  # compression runs inside the prefill
            peak = (peak_bytes, peak_tokens)
        if shared is not None:  # later questions on this context decode from copies of this cache
            shared[variant.name] = (cache, peak)
            cache = share(cache)
        after = evictor(cache, variant.policy)
        outcomes.append(run(variant.name, cache, seconds, after, peak))
    if shared is not None:
        shared["baseline"] = (full, (full_bytes, prompt.n_context))
    return baseline, outcomes


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
    outcomes = []
    for variant in [None, *variants]:
        name = "baseline" if variant is None else variant.name
        stored, peak = shared[name]
        cache = share(stored)
        held = Held.of(cache)
        retained = retained_fraction(cache, prompt.evidence)
        policy = variant.policy if variant is not None else None
        after = evictor(cache, policy) if policy is not None else None
        t = time.perf_counter()
        if forced:
            dec = teacher_forced(model, cache, question, after)
        else:
            dec = greedy(model, cache, question, max_new_tokens, stop_ids, after)
        seconds = {"prefill": 0.0, "compress": 0.0, "decode": time.perf_counter() - t}
        outcomes.append(outcome(name, held, cache, dec, peak, retained, seconds))
    return outcomes[0], outcomes[1:]
