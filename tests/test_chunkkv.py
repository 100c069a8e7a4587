"""ChunkKV (policies/chunkkv.py): whole chunks ranked by the inner policy's summed scores, the budget exact.

The chunks kept are derived by hand on small inputs whose inner scores are set directly; on the tiny model the
wrapper keeps the invariants of every policy (identity at 1.0, the exact budget after the prefill and every decode
step, protected tokens); through the command line it runs beside its inner policy on the same samples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from evalkit.cli.config import variants
from evalkit.engine.engine import greedy, prefill
from evalkit.errors import ConfigError
from evalkit.kv.cache import enforce, held_per_layer
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.chunkkv import ChunkKV
from evalkit.policies.h2o import H2O
from evalkit.policies.snapkv import SnapKV
from tests.conftest import CTX, STEPS, compose_config, compressed, policy, run_cli


@dataclass(kw_only=True)
class Given(KVPolicy):
    """An inner policy whose score is the first key dimension (set by hand) and that protects the last `last`
    positions."""

    name: str = "given"
    last: int = 0
    decode: bool = False

    def score(self, view: LayerView) -> Tensor:
        return view.keys[..., 0]

    def protected(self, view: LayerView, k: int) -> Tensor:
        return view.positions >= view.seen - self.last


def view_of(scores: list[list[float]]) -> LayerView:
    """A layer whose KV heads hold positions 0..T-1 with these inner scores (one list per head)."""
    s = torch.tensor(scores).unsqueeze(0)  # (1, Hkv, T)
    t = s.shape[-1]
    keys = s.unsqueeze(-1)
    return LayerView(0, 1, t, keys, keys.clone(), torch.arange(t).expand(1, s.shape[1], t))


def kept(pol: ChunkKV, view: LayerView, k: int) -> list[list[int]]:
    return pol.select(view, k)[0].tolist()


# Two KV heads, 12 tokens, chunks of 4: A = 0..3, B = 4..7, C = 8..11.
TWO_HEADS = [
    [1, 1, 1, 1, 5, 0, 0, 0, 2, 2, 2, 2],  # chunk sums A 4, B 5, C 8
    [3, 3, 3, 3, 0, 0, 0, 9, 0, 1, 0, 0],  # chunk sums A 12, B 9, C 1
]


def test_layer_ranks_chunks_by_summed_scores_and_fills_the_budget_from_the_next_chunk():
    pol = ChunkKV(inner=Given(), chunk_size=4, budget=6)
    # The layer's chunk sums: A 4 + 12 = 16, B 5 + 9 = 14, C 8 + 1 = 9, so A, B, C. k = 6: A whole (4 tokens),
    # then the 2 best of B by the layer's token scores (pos 4: 5 + 0 = 5, pos 5: 0, pos 6: 0, pos 7: 0 + 9 = 9):
    # 7 and 4. Both heads keep the same tokens.
    assert kept(pol, view_of(TWO_HEADS), 6) == [[0, 1, 2, 3, 4, 7]] * 2
    assert kept(pol, view_of(TWO_HEADS), 8) == [list(range(8))] * 2  # a multiple of the chunk: A and B whole
    # A plain top-6 of the same scores would scatter: head 0 keeps 4 and 8..11 (and one of the 1s)
    assert {4, 8, 9, 10, 11} < set(Given(budget=6).select(view_of(TWO_HEADS), 6)[0, 0].tolist())


def test_per_head_each_head_ranks_its_own_chunks():
    pol = ChunkKV(inner=Given(), chunk_size=4, budget=6, per_head=True)
    # head 0: C (8) > B (5) > A (4): C whole, then B's best 2: pos 4 (5), then pos 5 (a tie at 0: the earlier)
    # head 1: A (12) > B (9) > C (1): A whole, then B's best 2: pos 7 (9), then pos 4 (a tie at 0: the earlier)
    assert kept(pol, view_of(TWO_HEADS), 6) == [[4, 5, 8, 9, 10, 11], [0, 1, 2, 3, 4, 7]]


def test_protected_tokens_first_and_partial_chunks_ranked_by_their_mean():
    # 14 tokens, chunks of 4: A = 0..3, B = 4..7, C = 8..11, D = 12..13; the inner policy protects 11, 12, 13.
    scores = [[1, 1, 1, 1, 0, 3, 0, 0, 1.2, 1.2, 1.2, -100, 7, 7]]
    pol = ChunkKV(inner=Given(last=3), chunk_size=4, budget=8)
    # Candidates: A (4, sum 4), B (4, sum 3), C (8, 9, 10: sum 3.6; mean 1.2 x 4 = 4.8), D (none). The protected
    # token 11 does not count in C (with its -100, C would rank last). Ranks: C 4.8 > A 4 > B 3.
    # k = 8: the 3 protected, C's 3 candidates whole, then A does not fit (4 > 2): its best 2, ties to the
    # earlier, 0 and 1. Ranked by plain sums (A 4 > C 3.6) A would be kept whole instead.
    assert kept(pol, view_of(scores), 8) == [[0, 1, 8, 9, 10, 11, 12, 13]]
    assert kept(pol, view_of(scores), 3) == [[11, 12, 13]]
    with pytest.raises(ValueError, match="3 protected tokens exceed the 2 kept"):
        pol.select(view_of(scores), 2)


def test_wrapper_takes_needs_window_protection_and_modes_from_its_inner_policy():
    snap = ChunkKV(inner=SnapKV(window=8), budget=0.25)
    assert snap.name == "chunkkv(snapkv)" and snap.chunk_size == 10  # the paper's default chunk
    assert snap.needs() == SnapKV(window=8).needs() and snap.observation_window() == 8 and snap.min_tokens() == 9
    assert snap.decode is False and snap.inner.budget == 0.25  # the inner policy takes the wrapper's budget
    h2o = ChunkKV(inner=H2O(), budget=40)
    assert h2o.needs() == H2O().needs() and h2o.decode is True and h2o.inner.budget == 40
    pyramid = policy("chunkkv", 0.25, inner="pyramidkv")
    assert not pyramid.decodable and not pyramid.chunkable
    with pytest.raises(ConfigError, match=r"chunkkv\(pyramidkv\) compresses once"):
        policy("chunkkv", 0.25, inner="pyramidkv", decode=True).validate(None)
    with pytest.raises(ConfigError, match="^chunk_size=0: a chunk holds at least 1 token"):
        ChunkKV(inner=Given(), chunk_size=0).validate(None)
    with pytest.raises(ConfigError, match=r"^inner.window=0: the observation window needs at least 1"):
        policy("chunkkv", 0.25, inner="{name:snapkv,window:0}").validate(None)


def test_variants_name_wrappers_in_either_syntax():
    cfg = compose_config(
        "model=tiny-random", 'variants=["chunkkv(snapkv)@0.25",chunkkv/h2o@64,"chunkkv(knorm)@0.5+int4"]'
    )
    got = variants(cfg)
    assert [v.name for v in got] == ["chunkkv(snapkv)@0.25", "chunkkv(h2o)@64", "chunkkv(knorm)@0.5+int4"]
    assert [v.policy.inner.budget for v in got] == [0.25, 64, 0.5]
    duplicate = compose_config("model=tiny-random", 'variants=["chunkkv(snapkv)@0.25",chunkkv/snapkv@0.25]')
    with pytest.raises(ConfigError, match=r"\['chunkkv\(snapkv\)@0.25'\] are listed more than once"):
        variants(duplicate)


# --- on the tiny model ----------------------------------------------------------------------------------------

INNER = {"snapkv": "{name:snapkv,window:8}", "h2o": "h2o"}  # SnapKV with the 8-token window of the other tests


@pytest.mark.parametrize("inner", list(INNER))
def test_identity_at_full_budget_reproduces_full_cache_logits(tiny, ids, inner):
    full = share_prefill(tiny, ids)
    base = greedy(tiny.model, full, ids[:, CTX:], STEPS, set())
    pol = policy("chunkkv", 1.0, inner=INNER[inner], decode=True)
    _, cache = compressed(tiny.model, ids, pol)
    got = greedy(tiny.model, cache, ids[:, CTX:], STEPS, set(), lambda: enforce(cache, pol))
    assert got.tokens == base.tokens
    for a, b in zip(got.logits, base.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def share_prefill(tiny, ids):
    from evalkit.kv.cache import share

    return share(prefill(tiny.model, ids[:, :CTX])[0])


@pytest.mark.parametrize("budget", [0.25, 40])
def test_budget_exact_per_layer_and_head_after_prefill_and_every_decode_step(tiny, ids, budget):
    pol = policy("chunkkv", budget, inner="h2o")  # decode=true, from H2O
    assert pol.decode
    _, cache = compressed(tiny.model, ids, pol)
    # ceil(0.25 * 96) = 24, or the 40 tokens asked; then ceil(0.25 * seen) for seen = 103 ... 108
    assert held_per_layer(cache) == [{0.25: 24, 40: 40}[budget]] * 3
    held = []

    def after():
        enforce(cache, pol)
        held.append(held_per_layer(cache))
        for layer in cache.layers:  # one distinct position per held key, in every head
            assert all(len(set(head.tolist())) == head.numel() for head in layer.positions[0])

    greedy(tiny.model, cache, ids[:, CTX:], STEPS, set(), after)
    assert held == [[k] * 3 for k in {0.25: [26, 26, 27, 27, 27, 27], 40: [40] * STEPS}[budget]]


def test_keeps_the_window_and_whole_chunks_the_same_in_every_head(tiny, ids):
    pol = policy("chunkkv", 0.25, inner=INNER["snapkv"])
    first, again = (compressed(tiny.model, ids, pol)[1] for _ in range(2))
    for layer, same in zip(first.layers, again.layers, strict=True):
        assert torch.equal(layer.positions, same.positions)  # deterministic
        heads = layer.positions[0].tolist()
        assert all(head == heads[0] for head in heads)  # per_head=false: the layer's heads keep the same tokens
        # ceil(0.25 * 96) = 24 = the window 88..95, then 16 candidates: chunks of 10 (chunk 8 = 80..87 here, its
        # 88 and 89 are in the window): one whole chunk and 6 of the next, or 80..87 and 8 of another
        assert set(range(88, 96)) <= set(heads[0])
        by_chunk: dict[int, int] = {}
        for p in heads[0]:
            if p < 88:
                by_chunk[p // 10] = by_chunk.get(p // 10, 0) + 1
        whole = {c: n for c, n in by_chunk.items() if n == (8 if c == 8 else 10)}
        assert sum(by_chunk.values()) == 16 and len(by_chunk) - len(whole) <= 1  # at most one partial chunk


def test_cli_runs_chunkkv_beside_its_inner_policy_on_the_same_samples(tmp_path):
    args = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]"]
    result = run_cli(*args, 'variants=["chunkkv(snapkv)@0.5",snapkv@0.5]', f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    by_variant = {r["variant"]: r for r in rows}
    assert sorted(by_variant) == ["baseline", "chunkkv(snapkv)@0.5", "snapkv@0.5"]
    assert {r["sample_id"] for r in rows} == {rows[0]["sample_id"]}  # one sample, every variant on it
    n = by_variant["baseline"]["context_tokens"]
    assert n == 128
    for name in ("chunkkv(snapkv)@0.5", "snapkv@0.5"):
        assert by_variant[name]["tokens_held_per_layer"] == [64] * 3  # ceil(0.5 * 128) in each of the 3 layers
    recorded = by_variant["chunkkv(snapkv)@0.5"]["policy"]
    assert recorded["name"] == "chunkkv(snapkv)" and recorded["chunk_size"] == 10 and not recorded["per_head"]
    assert recorded["inner"] == {**by_variant["snapkv@0.5"]["policy"]}  # the same SnapKV, the wrapper's budget


def test_chunked_prefill_keeps_the_budget_after_every_chunk(tiny, ids):
    """The wrapper supports a chunked prefill when its inner policy does (H2O): after each 32-token chunk every
    layer holds the budget for the tokens seen, so the cache never holds more than the budget plus one chunk."""
    from evalkit.engine.engine import chunked_prefill

    pol = policy("chunkkv", 24, inner="h2o")
    cache, _, peak_tokens = chunked_prefill(tiny.model, ids[:, :CTX], pol, 32)
    assert held_per_layer(cache) == [24] * 3 and cache.get_seq_length() == CTX
    assert peak_tokens == 24 + 32  # the budget plus one chunk, at the second and third chunks
