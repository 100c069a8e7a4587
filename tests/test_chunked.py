"""Chunked prefill: the context goes in `chunk` tokens at a time and the policy evicts after each chunk.

Proven three ways on the tiny model: a policy that keeps everything reproduces the one-shot logits exactly; the
cache never holds more than budget + chunk tokens (measured); and the tokens kept equal those of a plain
reference that runs transformers' eager attention chunk by chunk over a plain cache, gathers by hand, and scores
from the materialised attention matrices.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from evalkit.cache import held_per_layer, kv_bytes
from evalkit.engine import CHUNKABLE, Variant, chunked_prefill, greedy, prefill
from evalkit.errors import ConfigError
from evalkit.policies import gather_tokens
from tests.conftest import CTX, by_kv_head, compose_config, policy, pool_by_hand, top_k

BUDGET, CHUNK = 40, 16


def reference_positions(eager, ids: torch.Tensor, name: str, pol, chunk: int) -> list[torch.Tensor]:
    """Per layer, the absolute positions each KV head holds after a chunked prefill, computed plainly."""
    cache = DynamicCache(config=eager.config)
    n_layers = eager.config.num_hidden_layers
    hkv = eager.config.num_key_value_heads
    pos = [torch.empty(1, hkv, 0, dtype=torch.long) for _ in range(n_layers)]
    mass = [torch.empty(1, hkv, 0) for _ in range(n_layers)]
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        c, seen = piece.shape[1], start + piece.shape[1]
        with torch.inference_mode():  # absolute RoPE positions; the plain cache holds only what was kept
            out = eager(
                input_ids=piece,
                position_ids=torch.arange(start, seen)[None],
                cache=cache,
                use_cache=True,
                output_attentions=True,
            )
        k = min(seen, BUDGET)
        for i, (layer, attn) in enumerate(zip(cache.layers, out.attentions, strict=True)):
            pos[i] = torch.cat([pos[i], torch.arange(start, seen).expand(1, hkv, c)], dim=-1)
            mass[i] = torch.cat([mass[i], mass[i].new_zeros(1, hkv, c)], dim=-1) + by_kv_head(attn.sum(dim=2), hkv)
            if layer.keys.shape[-2] <= k:
                continue
            if name == "h2o":
                keep = top_k(mass[i], pos[i] >= seen - int(pol.recent * k), k)
            elif name == "snapkv":
                win = by_kv_head(attn[:, :, -pol.window :, : -pol.window].sum(dim=2), hkv)  # the prefix only
                pooled = pool_by_hand(win, pol.kernel, pol.pooling)
                keep = top_k(
                    torch.cat([pooled, pooled.new_zeros(1, hkv, pol.window)], -1), pos[i] >= seen - pol.window, k
                )
            elif name == "knorm":
                keep = top_k(-layer.keys.norm(dim=-1), torch.zeros_like(pos[i], dtype=torch.bool), k)
            else:  # streaming_llm: the sinks, then the most recent
                keep = top_k(pos[i].float(), pos[i] < pol.n_sink, k)
            layer.keys, layer.values = gather_tokens(layer.keys, keep), gather_tokens(layer.values, keep)
            pos[i], mass[i] = gather_tokens(pos[i], keep), gather_tokens(mass[i], keep)
    return pos


@pytest.mark.parametrize("name", ["h2o", "snapkv", "knorm", "streaming_llm"])
def test_kept_tokens_equal_a_plain_chunk_by_chunk_reference(tiny, eager, ids, name):
    pol = policy(name, BUDGET)
    cache, _, _ = chunked_prefill(tiny.model, ids[:, :CTX], pol, CHUNK)
    want = reference_positions(eager, ids[:, :CTX], name, pol, CHUNK)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.positions, want[i]), f"layer {i}"


@pytest.mark.parametrize("name", CHUNKABLE)
def test_keeping_everything_in_chunks_reproduces_the_one_shot_logits(tiny, ids, name):
    full, _ = prefill(tiny.model, ids[:, :CTX])
    chunked, _, _ = chunked_prefill(tiny.model, ids[:, :CTX], policy(name, 1.0), CHUNK)
    a = greedy(tiny.model, full, ids[:, CTX:], 4, set())
    b = greedy(tiny.model, chunked, ids[:, CTX:], 4, set())
    assert a.tokens == b.tokens
    for x, y in zip(a.logits, b.logits, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in CHUNKABLE if n != "none"])  # none keeps everything by definition
@pytest.mark.parametrize("chunk", [CHUNK, 7])
def test_the_cache_never_holds_more_than_budget_plus_one_chunk(tiny, ids, name, chunk):
    cache, peak_bytes, peak_tokens = chunked_prefill(tiny.model, ids[:, :CTX], policy(name, BUDGET), chunk)
    full, _ = prefill(tiny.model, ids[:, :CTX])
    per_token = kv_bytes(full) / CTX  # every layer of the tiny Llama is full attention
    assert held_per_layer(cache) == [BUDGET] * len(cache.layers)
    assert BUDGET < peak_tokens <= BUDGET + chunk  # it did hold a chunk over the budget, never more
    assert peak_bytes <= (BUDGET + chunk) * per_token
    assert peak_bytes < kv_bytes(full)


def variants(*overrides: str):
    from evalkit.config import variants

    return variants(compose_config(*overrides))


def test_prefill_chunked_runs_every_variant_chunked_and_one_shot():
    names = [v.name for v in variants("policy=h2o", "policy.budget=1024", "prefill=chunked", "prefill.chunk=256")]
    assert names == ["h2o@1024", "h2o@1024:chunk256"]
    alone = variants("policy=h2o", "prefill=chunked", "prefill.compare_oneshot=false")
    assert [v.chunk for v in alone] == [512]
    listed = variants("variants=[snapkv@0.5,h2o@64:chunk32]")
    assert [(v.name, v.chunk) for v in listed] == [("snapkv@0.5", None), ("h2o@64:chunk32", 32)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("policy=pyramidkv", "prefill=chunked"), "pyramidkv does not support a chunked prefill"),
        (("policy=snapkv", "prefill=chunked", "prefill.chunk=16"), "shorter than snapkv's observation window"),
        (("policy=h2o", "prefill=chunked", "prefill.chunk=0"), "prefill.chunk=0"),
        (("policy=h2o", "policy.decode=false", "quant=int4", "prefill=chunked"), "drop \\+int4"),
        (("variants=[h2o@64:chunks32]",), "':chunkN'"),
    ],
)
def test_chunked_config_errors_name_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        variants(*overrides)


def test_a_variant_validates_its_chunk():
    with pytest.raises(ConfigError, match="whole number"):
        Variant(policy("h2o", 64), chunk=2.5).validate()


def test_a_chunked_run_records_its_bounded_peak_and_the_gate_report_sets_it_beside_one_shot(tmp_path):
    from evalkit.gate import Thresholds, gate
    from evalkit.records import SAMPLES, read_rows
    from evalkit.run import run

    cfg = compose_config(
        "model=tiny-random", "task.context_lengths=[256]", "task.depths=[0.0,1.0]", "policy=h2o", "policy.budget=64"
    )
    cfg.prefill = compose_config("prefill=chunked").prefill
    cfg.prefill.chunk = 32
    run(cfg, tmp_path)
    rows = {
        r["variant"]: r
        for r in read_rows(tmp_path / SAMPLES)
        if r["sample_id"] == read_rows(tmp_path / SAMPLES)[0]["sample_id"]
    }
    assert set(rows) == {"baseline", "h2o@64", "h2o@64:chunk32"}
    chunked, oneshot = rows["h2o@64:chunk32"], rows["h2o@64"]
    per_token = oneshot["kv_bytes_baseline"] / oneshot["context_tokens"]
    assert chunked["prefill"] == {"mode": "chunked", "chunk": 32} and oneshot["prefill"] == {"mode": "oneshot"}
    assert 64 < chunked["prefill_peak_tokens"] <= chunked["prefill_bound_tokens"] == 64 + 32
    assert chunked["prefill_peak_kv_bytes"] <= (64 + 32) * per_token < oneshot["prefill_peak_kv_bytes"]
    assert oneshot["prefill_peak_kv_bytes"] == oneshot["kv_bytes_baseline"]  # one shot: the full cache existed
    verdict = gate([tmp_path], Thresholds(min_samples=1, min_baseline_accuracy=None))
    (c,) = verdict.chunked
    assert (c["variant"], c["chunk"], c["n"]) == ("h2o@64", 32, 2)
    md = (tmp_path / "report.md").read_text()
    assert "Chunked vs one-shot prefill" in md and "| h2o@64 | 32 | 2 |" in md
