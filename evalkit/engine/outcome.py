"""What a variant (or the baseline) did on one sample, and the decoding of all of a sample's caches.

`decode_variants` decodes every cache prepared for a sample: caches whose kept tokens equal an earlier one's, stored the
same way and never evicting while decoding, reuse that decode (the outcome records whose, `decoded_like`); the rest
decode greedily in one batch (evalkit.engine.decode.decode_lanes, batched), or one by one when teacher-forced or on a
model with sliding-window layers. A batch's seconds are shared out evenly among its caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from evalkit.engine.decode import Decoded, Lane, batchable, decode_lanes
from evalkit.kv.cache import (
    allocated_per_layer,
    allowed_per_layer,
    deployed_bytes,
    fp16_bytes,
    held_per_layer,
    held_positions,
    kv_bytes,
    retained_fraction,
)
from evalkit.kv.quantized import attention_path


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
    # the most the cache decoded from held as deployed (cache.deployed_bytes): after compression, the question and
    # every generated token, before each eviction
    decode_peak_kv_bytes_deployed: int
    prefill_peak_kv_bytes: int  # the most held while the context went through the model
    prefill_peak_tokens: int  # the most tokens an evicting layer held (per KV head) during the prefill
    tokens_held: list[int | float]  # per layer and KV head (a ragged layer: the mean), right after compression
    evidence_retained: list[float]  # per layer, fraction of the evidence tokens still held
    seconds: dict[str, float] = field(default_factory=dict)
    # how the quantized layers attended (evalkit.kv.quantized): dense (none quantized), dequantized-cache (the CPU's
    # copy), packed-triton or packed-reference (the packed store, read by the Triton kernel or the PyTorch reference)
    attention_path: str = "dense"
    tokens_allocated: list[int] = field(default_factory=list)  # per layer, slots per KV head (ragged: the longest)
    # per layer, the tokens per KV head the policy contract allowed (budget + declared protected; evalkit.contract)
    tokens_allowed: list[int | float] = field(default_factory=list)
    decoded_like: str | None = None  # the variant whose decode this one reused: the same kept tokens, stored alike
    decode_batch: int = (
        1  # caches decoded together in one batch (evalkit.engine.decode.decode_lanes), this one included
    )


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
    decoded_like: str | None = None,
    decode_batch: int = 1,
) -> Outcome:
    """The Outcome of a decode (or teacher-forced pass) over `cache`, which held `held` before it began;
    `prefill_peak`: (bytes, tokens) at most while the context was prefilled."""
    return Outcome(
        variant=name,
        tokens=dec.tokens,
        logits=dec.logits,
        kv_bytes=held.kv_bytes,
        kv_bytes_fp16=held.fp16,
        kv_bytes_deployed=held.deployed,
        kv_bytes_final=kv_bytes(cache),
        peak_kv_bytes=max(dec.peak_bytes, held.kv_bytes, prefill_peak[0]),  # before every eviction: what was held
        decode_peak_kv_bytes_deployed=max(dec.peak_deployed, held.deployed),
        prefill_peak_kv_bytes=prefill_peak[0],
        prefill_peak_tokens=prefill_peak[1],
        tokens_held=held.tokens,
        evidence_retained=list(retained),
        seconds=dict(seconds or {}),
        attention_path=attention_path(cache),
        tokens_allocated=held.allocated,
        tokens_allowed=held.allowed,
        decoded_like=decoded_like,
        decode_batch=decode_batch,
    )


@dataclass
class VariantDecode:
    """One variant's (or the baseline's) cache to decode for a sample, with what its outcome needs besides the
    decode."""

    name: str
    cache: Cache
    seconds: dict[str, float]  # prefill, compression, ... (decode is added)
    prefill_peak: tuple[int, int]  # (bytes, tokens) at most while the context was prefilled
    after: Callable[[], None] | None = None  # eviction after every forward (engine.evictor)
    shareable: bool = False  # stores its kept tokens plainly and never evicts while decoding: may share a decode
    held: Held | None = None  # filled by decode_variants, before any decoding
    retained: list[float] = field(default_factory=list)


def same_kept(a: Cache, b: Cache) -> bool:
    """Whether two caches hold the same tokens in every layer and KV head (and so, gathered from the same prefill,
    the same keys and values)."""
    for x, y in zip(a.layers, b.layers, strict=True):
        px, py = held_positions(x), held_positions(y)
        if px.shape != py.shape or not torch.equal(px.sort(dim=-1).values, py.sort(dim=-1).values):
            return False
    return True


def decode_variants(
    model: torch.nn.Module,
    jobs: list[VariantDecode],
    question: Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    forced: bool,
    evidence: list[int],
) -> list[Outcome]:
    """The outcome of every job: its held bytes and tokens, then the question and answer decoded over its cache
    (teacher-forced when `forced`), sharing decodes between jobs that keep the same tokens."""
    like: dict[int, int] = {}  # job -> the earlier job whose decode it reuses
    for i, job in enumerate(jobs):
        job.held, job.retained = Held.of(job.cache), retained_fraction(job.cache, evidence)
        if job.shareable:
            firsts = (j for j in range(i) if like.get(j) == j and same_kept(jobs[j].cache, job.cache))
            like[i] = next(firsts, i)
    run = [i for i in range(len(jobs)) if like.get(i, i) == i]
    lanes = [Lane(jobs[i].cache, jobs[i].after) for i in run]
    got = run_decodes(model, lanes, question, max_new_tokens, stop_ids, forced)
    by_job = dict(zip(run, got, strict=True))
    outcomes = []
    for i, job in enumerate(jobs):
        first = like.get(i, i)
        dec, secs, batch = by_job[first]
        out = outcome(
            job.name,
            job.held,
            jobs[first].cache,
            dec,
            job.prefill_peak,
            job.retained,
            {**job.seconds, "decode": secs if first == i else 0.0},
            decoded_like=jobs[first].name if first != i else None,
            decode_batch=batch,
        )
        outcomes.append(out)
    return outcomes


def run_decodes(
    model: torch.nn.Module, lanes: list[Lane], question: Tensor, max_new_tokens: int, stop_ids: set[int], forced: bool
) -> list[tuple[Decoded, float, int]]:
    """Decode each lane's cache: greedy ones that can batch in one batch, the others alone. Returns per lane the
    decode, its seconds (a batch's shared out evenly) and the number of caches decoded with it."""
    together = [] if forced else [i for i, lane in enumerate(lanes) if batchable(lane.cache)]
    decoded: dict[int, tuple[Decoded, float, int]] = {}
    if together:
        t = time.perf_counter()
        got = decode_lanes(model, [lanes[i] for i in together], question, max_new_tokens, stop_ids, batched=True)
        share = (time.perf_counter() - t) / len(together)
        decoded.update({i: (dec, share, len(together)) for i, dec in zip(together, got, strict=True)})
    for i, lane in enumerate(lanes):
        if i in decoded:
            continue
        t = time.perf_counter()
        (dec,) = decode_lanes(model, [lane], question, max_new_tokens, stop_ids, forced=forced)
        decoded[i] = (dec, time.perf_counter() - t, 1)
    return [decoded[i] for i in range(len(lanes))]
