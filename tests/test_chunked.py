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

from evalkit.engine.engine import chunked_prefill, greedy, prefill
from evalkit.errors import ConfigError
from evalkit.kv.cache import held_per_layer, kv_bytes
from evalkit.kv.variant import Variant
from tests.conftest import CTX, ROOT, by_kv_head, compose_config, policy, pool_by_hand

BUDGET, CHUNK = 40, 16
# The policies whose choice can be made again after every chunk; PyramidKV's per-layer budgets are defined for the
# whole prompt only. Checked against the classes' declarations below.
CHUNKABLE = ("none", "streaming_llm", "h2o", "snapkv", "knorm", "random", "window", "keydiff", "tova", "qfilter")
CHUNKABLE += ("chunkkv", "criticalkv", "per_layer", "merging")  # wrappers over snapkv


def test_policies_declare_whether_they_can_evict_chunk_by_chunk():
    names = sorted(p.stem for p in (ROOT / "conf" / "policy").glob("*.yaml"))
    assert sorted(n for n in names if policy(n, 1.0).chunkable) == sorted(CHUNKABLE)
    assert not policy("pyramidkv", 1.0).chunkable


WINDOW = 8  # tests.conftest.policy gives SnapKV an 8-token observation window


def reference_positions(eager, ids: torch.Tensor, name: str, chunk: int) -> list[torch.Tensor]:
    """Per layer, the absolute positions each KV head holds after a chunked prefill at a budget of 40 tokens,
    computed plainly from each paper's definition, with none of evalkit's helpers."""
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
        k = min(seen, BUDGET)  # an absolute budget of 40 tokens: all of them while fewer have been seen
        for i, (layer, attn) in enumerate(zip(cache.layers, out.attentions, strict=True)):
            pos[i] = torch.cat([pos[i], torch.arange(start, seen).expand(1, hkv, c)], dim=-1)
            mass[i] = torch.cat([mass[i], mass[i].new_zeros(1, hkv, c)], dim=-1) + by_kv_head(attn.sum(dim=2), hkv)
            held = layer.keys.shape[-2]
            if held <= k:
                continue
            if name == "h2o":
                # H2O: int(0.5 * 40) = 20 most recent held tokens, and the 20 of largest accumulated attention among
                # the others
                heavy = mass[i][..., : held - 20].topk(k - 20, dim=-1).indices
                keep = with_indices(heavy, range(held - 20, held), hkv)
            elif name == "snapkv":
                # SnapKV: the latest chunk's last 8 queries (the window) on the held tokens before them, summed,
                # avg-pooled with kernel 5 over those tokens only (zero padding counted); top 40 - 8, and the window
                win = by_kv_head(attn[:, :, -WINDOW:, :-WINDOW].sum(dim=2), hkv)
                pooled = pool_by_hand(win, 5, "avg")
                keep = with_indices(pooled.topk(k - WINDOW, dim=-1).indices, range(held - WINDOW, held), hkv)
            elif name == "knorm":  # the 40 keys of lowest L2 norm
                keep = with_indices(layer.keys.norm(dim=-1).topk(k, dim=-1, largest=False).indices, [], hkv)
            elif name == "keydiff":  # the 40 keys of lowest cosine to the mean of the held unit keys, per head
                unit = layer.keys / layer.keys.norm(dim=-1, keepdim=True)
                cos = (unit * unit.mean(dim=2, keepdim=True)).sum(-1) / unit.mean(dim=2).norm(dim=-1)[..., None]
                keep = with_indices(cos.topk(k, dim=-1, largest=False).indices, [], hkv)
            elif name == "tova":  # the chunk's last query, its attention averaged over the 4 query heads: one set
                mean = attn[0, :, -1].mean(dim=0)  # (held,)
                keep = with_indices(torch.empty(1, hkv, 0, dtype=torch.long), mean.topk(k).indices.tolist(), hkv)
            elif name == "window":  # the 40 most recent held tokens
                keep = with_indices(torch.empty(1, hkv, 0, dtype=torch.long), range(held - k, held), hkv)
            else:  # streaming_llm: the 4 sinks (held first, in order), then the 36 most recent held tokens
                assert torch.equal(pos[i][..., :4], torch.arange(4).expand(1, hkv, 4))
                keep = with_indices(torch.empty(1, hkv, 0, dtype=torch.long), [*range(4), *range(held - 36, held)], hkv)
            layer.keys, layer.values = take(layer.keys, keep), take(layer.values, keep)
            pos[i], mass[i] = take(pos[i], keep), take(mass[i], keep)
    return pos


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (1, Hkv, T[, D]) at the held indices idx (1, Hkv, m) of each head."""
    return torch.stack([torch.stack([x[0, h, i] for i in idx[0, h].tolist()]) for h in range(x.shape[1])])[None]


def with_indices(chosen: torch.Tensor, always, hkv: int) -> torch.Tensor:
    """Held indices (1, Hkv, m) chosen per head, with the indices every head keeps, ascending."""
    always = torch.tensor(list(always), dtype=torch.long).expand(1, hkv, -1)
    return torch.cat([chosen, always], dim=-1).sort(dim=-1).values


@pytest.mark.parametrize("name", ["h2o", "snapkv", "knorm", "streaming_llm", "keydiff", "tova", "window"])
def test_kept_tokens_equal_a_plain_chunk_by_chunk_reference(tiny, eager, ids, name):
    pol = policy(name, BUDGET)
    cache, _, _ = chunked_prefill(tiny.model, ids[:, :CTX], pol, CHUNK)
    want = reference_positions(eager, ids[:, :CTX], name, CHUNK)
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
    pol = policy(name, BUDGET)
    pol.prepare(tiny.model, None)  # as the engine does once the model is loaded
    cache, peak_bytes, peak_tokens = chunked_prefill(tiny.model, ids[:, :CTX], pol, chunk)
    full, _ = prefill(tiny.model, ids[:, :CTX])
    per_token = kv_bytes(full) / CTX  # every layer of the tiny Llama is full attention
    assert held_per_layer(cache) == [BUDGET] * len(cache.layers)
    assert BUDGET < peak_tokens <= BUDGET + chunk  # it did hold a chunk over the budget, never more
    assert peak_bytes <= (BUDGET + chunk) * per_token
    assert peak_bytes < kv_bytes(full)


def variants(*overrides: str):
    from evalkit.cli.config import variants

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
    from evalkit.cli.job import job_spec, run
    from evalkit.gate.gating import gate
    from evalkit.records import SAMPLES, read_rows
    from evalkit.thresholds import Thresholds

    cfg = compose_config(
        "model=tiny-random", "task.context_lengths=[256]", "task.depths=[0.0,1.0]", "policy=h2o", "policy.budget=64"
    )
    cfg.prefill = compose_config("prefill=chunked").prefill
    cfg.prefill.chunk = 32
    run(*job_spec(cfg, tmp_path))
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
    # Two samples cannot show a drop or flip-rate bound either way (INCONCLUSIVE): those checks are off, the chunked
    # table is what is checked here.
    off = {"max_drop": None, "max_flip_rate": None, "min_cell_accuracy": None, "min_baseline_accuracy": None}
    verdict = gate([tmp_path], Thresholds(min_samples=1, **off))
    (c,) = verdict.chunked
    assert (c["variant"], c["chunk"], c["n"]) == ("h2o@64", 32, 2)
    md = (tmp_path / "report.md").read_text()
    assert "Chunked vs one-shot prefill" in md and "| h2o@64 | 32 | 2 |" in md
