"""Decoding a sample's caches together (engine.decode.decode_lanes, batched) and sharing the decode of caches that keep
the same tokens (evalkit.engine.outcome.decode_variants): each variant's result must be what decoding it alone gives."""

from __future__ import annotations

import pytest
import torch

from evalkit.engine.decode import Lane, decode_lanes, greedy
from evalkit.engine.engine import Variant, evictor, prefill, run_sample
from evalkit.kv.cache import held_positions, kv_bytes, share
from evalkit.kv.quantized import QuantSpec
from evalkit.tasks.prompt import Prompt
from tests.conftest import CTX, compressed, policy

# dense and decode-time eviction (with H2O's running mass), a ragged layer, a quantized store, the full cache
SPECS = [
    ("snapkv", 0.25, {}),
    ("h2o", 0.25, {}),
    ("streaming_llm", 24, {}),
    ("adakv", 0.5, {}),
    ("kvzip", 0.25, {}),
    ("tova", 0.5, {"decode": True}),
]


@pytest.fixture(scope="module")
def prepared(tiny, ids):
    """Compressed caches for every spec, the full cache and an int4 store of it (the CPU's dequantized copy), each
    with its policy (None: no eviction while decoding), built once."""
    out = []
    for name, budget, extra in SPECS:
        pol = policy(name, budget, **extra)
        out.append((compressed(tiny.model, ids, pol)[1], pol))
    full, _ = prefill(tiny.model, ids[:, :CTX])
    out.append((full, None))
    out.append((int4(full, "dequantized-cache"), None))
    return out


def int4(full, path: str):
    """The full cache stored as int4: the CPU's dequantized copy, or the packed store read directly."""
    spec = QuantSpec(name="int4", bits=4, group=8, residual=16, cpu_path=path)
    return Variant(policy("none", 1.0), quant=spec).apply(full, {})


def caches(prepared, only=None):
    """Fresh rows over copies of the prepared caches (cache.share: a decode never reaches the original)."""
    rows = []
    for i, (cache, pol) in enumerate(prepared):
        if only is None or i in only:
            copy = share(cache)
            rows.append(Lane(copy, evictor(copy, pol) if pol is not None else None))
    return rows


def check_batch_equals_alone(tiny, ids, prepared, only, steps):
    """Tokens, logits (within float tolerance), the peak bytes and the cache left at the end (tokens held per head,
    bytes) of `decode_lanes(batched=True)` over the caches `only` must equal `greedy` on each cache alone. A random
    model's rows stop at different steps only if a stop id is hit, so none is given."""
    alone, together = caches(prepared, only), caches(prepared, only)
    want = [greedy(tiny.model, r.cache, ids[:, CTX:], steps, set(), r.after_forward) for r in alone]
    got = decode_lanes(tiny.model, together, ids[:, CTX:], steps, set(), batched=True)
    for a, b, ra, rb in zip(want, got, alone, together, strict=True):
        assert a.tokens == b.tokens and a.peak_bytes == b.peak_bytes and a.peak_deployed == b.peak_deployed
        for x, y in zip(a.logits, b.logits, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        assert kv_bytes(ra.cache) == kv_bytes(rb.cache)
        for la, lb in zip(ra.cache.layers, rb.cache.layers, strict=True):
            assert torch.equal(held_positions(la), held_positions(lb))


def test_a_batch_decodes_every_cache_as_it_decodes_alone(tiny, ids, prepared):
    """8 steps for caches that evict while decoding (H2O's running mass, StreamingLLM, TOVA's sliding window query),
    a ragged one, KVzip's global choice, the CPU's dequantized int4 copy and the full cache, in one batch."""
    check_batch_equals_alone(tiny, ids, prepared, set(range(len(prepared))), steps=8)


def test_a_packed_store_decodes_in_a_batch_as_alone(tiny, ids, prepared, monkeypatch):
    """The packed int4 store beside an evicting cache and the full one, read by the PyTorch reference kernel (the
    Triton kernel equals it, tests/test_kernels.py; interpreted on the CPU it would take minutes here)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    full = prepared[len(SPECS)][0]
    packed = int4(full, "packed")
    assert packed.layers[0].attention_path == "packed-reference"
    check_batch_equals_alone(tiny, ids, [prepared[1], (full, None), (packed, None)], {0, 1, 2}, steps=8)


def test_rows_leave_the_batch_at_their_stop_token(tiny, ids, prepared):
    """A row stops at its first stop id (kept as its last token), the others go on: stop on the token the full
    cache's row generates at step 3 (by its lone decode), and each row's tokens are its lone decode's."""
    only = {0, 1, 2, len(SPECS)}  # three evicting or compressed caches and the full one
    free = greedy(tiny.model, caches(prepared, {len(SPECS)})[0].cache, ids[:, CTX:], 6, set())
    stop = {free.tokens[2]}
    want = [greedy(tiny.model, r.cache, ids[:, CTX:], 6, stop, r.after_forward) for r in caches(prepared, only)]
    got = decode_lanes(tiny.model, caches(prepared, only), ids[:, CTX:], 6, stop, batched=True)
    assert [d.tokens for d in got] == [d.tokens for d in want]
    assert len(got[-1].tokens) <= 3


def test_run_sample_batches_the_variants_and_matches_one_variant_runs(tiny, ids):
    """Each variant's outcome in a sweep (one batch for the baseline and all variants) equals its outcome in a run
    of its own, and the rows say how many caches decoded together."""
    prompt = Prompt(ids, CTX, [10, 11], "query_agnostic")
    variants = [Variant(policy(n, b, **e)) for n, b, e in SPECS[1:5]]  # h2o, streaming_llm, adakv, kvzip
    base, outs = run_sample(tiny.model, prompt, variants, 5, set())
    assert base.decode_batch == len(variants) + 1 and all(o.decode_batch == len(variants) + 1 for o in outs)
    for v, out in zip(variants, outs, strict=True):
        alone_base, (alone,) = run_sample(tiny.model, prompt, [v], 5, set())
        assert out.tokens == alone.tokens and base.tokens == alone_base.tokens, v.name
        for x, y in zip(out.logits, alone.logits, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
        assert (out.kv_bytes, out.peak_kv_bytes, out.tokens_held) == (
            alone.kv_bytes,
            alone.peak_kv_bytes,
            alone.tokens_held,
        )


def test_a_variant_that_keeps_the_same_tokens_reuses_the_decode(tiny, ids):
    """snapkv at 24 tokens and at a quarter of 96 (ceil = 24) keep the same tokens: the second reuses the first's
    decode (decoded_like, no decode seconds) and has its tokens and logits; kvzip at 1.0 keeps everything, so it
    reuses the baseline's. A variant that evicts while decoding (h2o) never shares, even at the same budget."""
    prompt = Prompt(ids, CTX, [], "query_agnostic")
    variants = [
        Variant(policy("snapkv", 24)),
        Variant(policy("snapkv", 0.25)),
        Variant(policy("kvzip", 1.0)),
        Variant(policy("h2o", 24)),
        Variant(policy("h2o", 0.25)),
    ]
    base, (a, b, full, h1, h2) = run_sample(tiny.model, prompt, variants, 4, set())
    assert (a.decoded_like, b.decoded_like, full.decoded_like) == (None, "snapkv@24", "baseline")
    assert (h1.decoded_like, h2.decoded_like) == (None, None)
    assert b.seconds["decode"] == 0.0 and a.seconds["decode"] > 0
    assert b.tokens == a.tokens and full.tokens == base.tokens
    assert b.logits is not None and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    _, (alone,) = run_sample(tiny.model, prompt, [Variant(policy("snapkv", 0.25))], 4, set())
    assert alone.tokens == b.tokens and alone.decoded_like is None


@pytest.mark.parametrize("forced", [True])
def test_teacher_forced_runs_decode_one_by_one(tiny, ids, forced):
    """A teacher-forced continuation is fed to each cache alone (decode_batch is for greedy answers)."""
    prompt = Prompt(ids, CTX, [], "query_agnostic")
    base, (out,) = run_sample(tiny.model, prompt, [Variant(policy("h2o", 0.25))], 4, set(), forced=forced)
    assert base.decode_batch == out.decode_batch == 1 and len(out.logits) == ids.shape[1] - CTX - 1
