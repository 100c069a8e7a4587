"""Finch (kvpress's FinchPress): its scores against eager attention over the whole prompt written out, its kept set
and re-rotated keys, the question it needs, its refusals, end to end. The identity test and the cache invariants cover
it with every policy in conf/policy (tests/test_cache_invariants.py); kvpress's choices and keys on the real model in
tests/test_peer_kvpress.py."""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.engine.engine import prefill, reconstruction
from evalkit.errors import ConfigError
from evalkit.kv.cache import full_attention_layers
from evalkit.policies.finch import Finch
from evalkit.tasks.prompt import Repeat
from tests.conftest import CTX, compressed, run_cli, sliding_model, tiny_row
from tests.test_rewriting_policies import rope

Q = 8  # the context's last Q ids are the question here (tests.conftest.FINCH_QUESTION)


def scores_by_hand(eager, context: torch.Tensor, normalize: bool) -> list[torch.Tensor]:
    """Per layer, (Hkv, CTX - Q): from transformers' eager attention over the whole context (its own probabilities),
    the question's rows on the document's keys, each row times its position when `normalize`, averaged over the
    question's rows and the query heads of each KV head."""
    with torch.inference_mode():
        attentions = eager(context, output_attentions=True).attentions  # per layer (1, Hq, CTX, CTX)
    hkv = eager.config.num_key_value_heads
    out = []
    for probs in attentions:
        rows = probs[0, :, CTX - Q :, : CTX - Q].double()  # (Hq, Q, CTX - Q)
        if normalize:
            rows = rows * torch.arange(CTX - Q, CTX, dtype=torch.float64)[:, None]
        out.append(rows.mean(dim=1).view(hkv, -1, CTX - Q).mean(dim=1))
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_the_kept_tokens_are_the_question_and_the_best_of_eager_attention(tiny, eager, ids, normalize):
    """A quarter of 96 is 24 per head: the 8 question tokens and the 16 document tokens whose position-weighed attention
    from the question is highest in eager attention's own probabilities (the policy reads its queries from a pass of
    its own, so the scores agree to float error, and the kept sets exactly)."""
    want = scores_by_hand(eager, ids[:, :CTX], normalize)
    _, cache = compressed(tiny.model, ids, Finch(budget=0.25, normalize=normalize, rerotate=False))
    for i in full_attention_layers(cache):
        for h in range(want[i].shape[0]):
            best = want[i][h].topk(24 - Q).indices.sort().values.tolist()
            assert cache.layers[i].positions[0, h].tolist() == best + list(range(CTX - Q, CTX))
    pol = Finch(budget=0.25, normalize=normalize)
    pol.prepare(tiny.model, None)
    full, obs = prefill(tiny.model, ids[:, :CTX], [pol])
    reconstruction(tiny.model, full, ids[:, :CTX], Repeat(question=Q), [pol], obs)
    for i, layer_obs in obs.items():
        torch.testing.assert_close(layer_obs[pol.needs()[0]][0].double(), want[i], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("chunk_length", "per_chunk"), [(32, [16, 16, 16]), (40, [20, 20, 8])])
def test_chunk_length_keeps_each_chunks_share_by_the_whole_prompts_scores(tiny, eager, ids, chunk_length, per_chunk):
    """kvpress's chunk_length: half of 96 is 48 per head, shared over chunks of 32 (16 each) or of 40, 40 and 16
    (48 x 40 / 96 = 20, 20 and 8); within a chunk the best of the whole prompt's scores (eager attention written out,
    the question's 8 tokens above every document token), so the last chunk keeps the question first. Control: the
    chunked sets are not the one top-k's."""
    k = 48
    want = scores_by_hand(eager, ids[:, :CTX], True)
    _, cache = compressed(tiny.model, ids, Finch(budget=0.5, rerotate=False, chunk_length=chunk_length))
    _, whole = compressed(tiny.model, ids, Finch(budget=0.5, rerotate=False))
    assert sum(per_chunk) == k
    differs = False
    for i in full_attention_layers(cache):
        for h in range(want[i].shape[0]):
            scores = torch.cat([want[i][h], torch.full((Q,), float(want[i][h].max()) + 1, dtype=torch.float64)])
            best = []
            for n, start in zip(per_chunk, range(0, CTX, chunk_length), strict=True):
                best += (start + scores[start : start + chunk_length].topk(n).indices).tolist()
            assert cache.layers[i].positions[0, h].tolist() == sorted(best)
            assert set(range(CTX - Q, CTX)) <= set(best)  # the question, in the last chunk, kept first
            differs |= not torch.equal(cache.layers[i].positions[0, h], whole.layers[i].positions[0, h])
    assert differs
    with pytest.raises(ConfigError, match=r"^chunk_length=0: give a chunk of tokens such as 256, or null"):
        Finch(budget=0.25, chunk_length=0).validate(CTX)


def test_the_kept_keys_are_rerotated_to_their_slots_and_the_values_kept_as_they_were(tiny, ids):
    """The same tokens with and without re-rotation; each kept key, rotated back from its position and forward to its
    slot by transformers' RoPE, is what the cache holds; the values are the full cache's."""
    rotary = tiny.model.model.rotary_emb
    full, plain = compressed(tiny.model, ids, Finch(budget=0.25, rerotate=False))
    moved = compressed(tiny.model, ids, Finch(budget=0.25))[1]
    for i in full_attention_layers(moved):
        a, b = plain.layers[i], moved.layers[i]
        assert torch.equal(a.positions, b.positions) and torch.equal(a.values, b.values)
        assert not torch.equal(a.keys, b.keys)  # control: the document's kept keys did move
        for h in range(a.keys.shape[1]):
            pos = a.positions[0, h]
            want = rope(rope(a.keys[:, h : h + 1], -pos, rotary), torch.arange(len(pos)), rotary)
            torch.testing.assert_close(b.keys[:, h : h + 1], want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(a.values[:, h], full.layers[i].values[:, h, pos], rtol=0, atol=0)


def test_a_context_without_a_question_and_a_sliding_window_model_are_refused(tiny, ids):
    pol = Finch(budget=0.25)
    pol.prepare(tiny.model, None)
    full, obs = prefill(tiny.model, ids[:, :CTX], [pol])
    for prompt in (None, Repeat()):
        with pytest.raises(ConfigError, match=r"this context holds no question \(0 of its 96 tokens\): run it with "):
            reconstruction(tiny.model, full, ids[:, :CTX], prompt, [pol], obs)
    with pytest.raises(ConfigError, match="finch needs every layer to attend to the whole context"):
        Finch(budget=0.25).prepare(sliding_model(), None)


def test_the_command_line_runs_it_query_aware_and_refuses_query_agnostic_in_one_line(tmp_path):
    row = tiny_row(tmp_path / "ok", "policy=finch", "policy.budget=0.5", "protocol=query_aware")
    assert row["variant"] == "finch@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
    assert math.isfinite(row["seconds"]["question"])  # its pass over the question, timed as KVzip's is
    result = run_cli("model=tiny-random", "policy=finch", f"hydra.run.dir={tmp_path / 'no'}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "evalkit: error: finch scores the context by its question's attention, and protocol=query_agnostic compresses "
        "the context without the question: use protocol=query_aware"
    ], result.stderr
    wrapped = run_cli("model=tiny-random", "policy=chunkkv", "policy.inner=finch", f"hydra.run.dir={tmp_path / 'w'}")
    assert wrapped.returncode == 2 and "chunkkv(finch) scores the context by its question's" in wrapped.stderr
    decode = ("policy.decode=true", "protocol=query_aware")
    result = run_cli("model=tiny-random", "policy=finch", *decode, f"hydra.run.dir={tmp_path / 'de'}")
    assert result.returncode == 2, result.stderr
    assert "finch compresses once, after the prompt: set policy.decode=false" in result.stderr
