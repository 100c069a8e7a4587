"""KVzip (Kim et al. 2025, arXiv:2505.23416): scores from a second pass that reconstructs the context, checked against
plain eager attention and against values worked by hand; its pass leaves the baseline and the full cache untouched."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from evalkit.errors import ConfigError
from evalkit.kv.attention import ReconstructionObserver, max_attention_received
from evalkit.kv.cache import compress, kv_bytes
from evalkit.kv.variant import Variant
from evalkit.run.engine import prefill, reconstruction, run_sample
from evalkit.tasks import Sample
from evalkit.tasks.prompt import build_prompt
from tests.conftest import policy

# A chat template written for the test (the tiny tokenizer is byte-level and has none): a system turn, the user's
# message, then the assistant's turn opens. By hand: the opening is "<s>system: be brief.\n<u>", the text between the
# end of the user's message and the answer is "</u>\n<a>".
OPENING, SUFFIX = "<s>system: be brief.\n<u>", "</u>\n<a>"
TEMPLATE = (
    "<s>system: be brief.\n{% for m in messages %}<u>{{ m['content'] }}</u>\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
# kvpress KVzipPress's repeat prompts, copied from its source
FIRST, PART = (
    "\n\nRepeat the previous context exactly.",
    "\n\nRepeat the part of the previous context exactly, starting with",
)
CONTEXT = (
    "The harbour master logs every ship. On Tuesday the Aurora docked at pier 7 with 412 crates of tea; "
    "on Wednesday the Borealis left pier 3 empty."
)


@pytest.fixture(scope="module")
def chat(tiny):
    """The tiny model's byte-level tokenizer with the test's chat template."""
    tok = copy.deepcopy(tiny.tokenizer)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def prompt(chat):
    sample = Sample("s0", CONTEXT, "Which pier did the Aurora use?", ["7"], {}, evidence=["pier 7"])
    return build_prompt(chat, sample)


def test_repeat_prompt_is_kvpress_text_and_the_template_suffix(chat, prompt):
    """The repeat prompt must be kvpress's text, the template's end of the user turn and start of the answer, and
    the reconstruction must start at the first context token (catches a wrong suffix, a reconstructed template
    opening, or the instruction tokenised with special tokens)."""

    def ids(text):
        return chat(text, add_special_tokens=False)["input_ids"]

    assert prompt.repeat.start == len(ids(OPENING))  # byte-level: one token per byte of the opening
    assert prompt.ids[0, prompt.repeat.start :].tolist()[: len(ids(CONTEXT))] == ids(CONTEXT)
    assert prompt.repeat.first == ids(FIRST) and prompt.repeat.part == ids(PART)
    assert prompt.repeat.suffix == ids(SUFFIX)


def eager_scores(eager, context, start, first, part, suffix, sinks, chunk, prev=8):
    """The reconstruction scores from transformers' eager attention matrices over the whole sequence [context,
    repeat prompt, chunk of the context], one sequence per chunk, written from the paper and kvpress's description:
    per chunk [lo, hi) of the context after the template opening, each query of the repeat part attends over the
    first min(sinks, lo) keys, the chunk's keys and the repeat part's keys (the eager probabilities renormalised over
    those keys: the softmax over them alone); a key's score is its largest attention from any of those queries and
    any query head of its KV group. Tokens before `start` score 0. Returns per layer (Hkv, n)."""
    n = context.shape[1]
    hkv = eager.config.num_key_value_heads
    out = [torch.zeros(hkv, n) for _ in range(eager.config.num_hidden_layers)]
    los = list(range(start, n, chunk))
    for i, lo in enumerate(los):
        hi = min(lo + chunk, n)
        head = first + suffix if i == 0 else part + context[0, max(los[i - 1], lo - prev) : lo].tolist() + suffix
        seq = torch.cat([context, torch.tensor([head]), context[:, lo:hi]], dim=1)
        with torch.inference_mode():
            attentions = eager(input_ids=seq, output_attentions=True).attentions  # per layer (1, Hq, L, L)
        s = min(sinks, lo)
        cols = list(range(s)) + list(range(lo, hi)) + list(range(n, seq.shape[1]))
        for layer, attn in enumerate(attentions):
            p = attn[0][:, n:][:, :, cols]  # (Hq, repeat queries, subset)
            p = p / p.sum(-1, keepdim=True)
            chunk_cols = p[:, :, s : s + hi - lo]  # the chunk's keys
            per_head = chunk_cols.amax(dim=1)  # (Hq, hi - lo): max over the queries
            out[layer][:, lo:hi] = per_head.view(hkv, -1, hi - lo).amax(dim=1)  # and over each group's heads
    return out


@pytest.mark.parametrize("chunk_size", [2048, 40], ids=["one-pass", "chunks-of-40"])
def test_scores_and_kept_tokens_equal_eager_reconstruction(tiny, eager, prompt, chunk_size):
    """evalkit's pass (SDPA over a shared cache, observed in query chunks) must give the scores eager attention gives
    over [context, repeat prompt, context], and keep each head's top set of them plus the 4 sinks. Catches a softmax
    over the whole cache instead of sinks + chunk + own keys, a sum or mean instead of the max, a missing group max,
    a wrong repeat prompt or quote of the previous chunk, and reconstructing the template opening."""
    pol = policy("kvzip", 0.25, chunk_size=chunk_size)
    context = prompt.ids[:, : prompt.n_context]
    n = context.shape[1]
    rep = prompt.repeat
    full, obs = prefill(tiny.model, context, [pol])
    reconstruction(tiny.model, full, context, rep, [pol], obs)
    want = eager_scores(eager, context, rep.start, rep.first, rep.part, rep.suffix, 4, chunk_size)
    key = f"reconstruction:4:{chunk_size}"
    for layer, ref in enumerate(want):
        torch.testing.assert_close(obs[layer][key][0], ref, rtol=1e-4, atol=1e-6)
    k = math.ceil(0.25 * n)
    cache = compress(full, pol, obs)
    for layer, ref in enumerate(want):
        for h, head in enumerate(cache.layers[layer].positions[0].tolist()):
            assert set(range(4)) <= set(head)
            kept = [p for p in range(4, n) if p in set(head)]
            evicted = [p for p in range(4, n) if p not in set(head)]
            assert len(kept) == k - 4
            assert ref[h, kept].min() >= ref[h, evicted].max(), f"layer {layer} head {h}"
    assert (n - rep.start) > 2 * 40, "the 40-token chunks must split the context at least twice"


def test_max_over_queries_and_group_by_hand():
    """One KV head shared by two query heads, 1-d keys [ln 3, 0] before two queries (causal among themselves; their
    own keys are 0), scale 1. Head 0's queries are 1: query 0 sees ln3, 0, 0 -> 3/5, 1/5, 1/5; query 1 sees
    ln3, 0, 0, 0 -> 1/2, 1/6, 1/6, 1/6. Head 1's queries are 0: uniform, 1/3 (query 0) and 1/4 (query 1). Key 0:
    max(3/5, 1/2, 1/3, 1/4) = 3/5; key 1: max(1/5, 1/6, 1/3, 1/4) = 1/3, from head 1's first query. A sum over the
    queries, head 0 alone, or a query seeing a later key (1/4 for head 1) gives other values."""
    query = torch.tensor([[1.0, 1.0], [0.0, 0.0]]).view(1, 2, 2, 1)  # (B, Hq, Tq, D)
    key = torch.tensor([math.log(3), 0.0, 0.0, 0.0]).view(1, 1, 4, 1)  # (B, Hkv, Tk, D)
    for chunk_elements in (1, 1 << 24):  # one query per chunk, and all at once
        got = max_attention_received(query, key, 1.0, (0, 2), chunk_elements)
        torch.testing.assert_close(got, torch.tensor([[[3 / 5, 1 / 3]]]))


def test_observer_softmax_spans_sinks_chunk_and_own_keys_only_by_hand():
    """Six cached keys, one sink, the chunk [3, 5), two repeat queries whose scores are all 0: each query's softmax
    is uniform over what it sees of key 0, keys 3 and 4 and the repeat keys: 1/4 (first query: 3 cached + its own)
    and 1/5, so keys 3 and 4 score 1/4, and every other cached key 0. Over the whole cache it would be 1/7; catches
    keys 1, 2 or 5 taking a share, and a score written outside the chunk."""
    scores = {0: torch.zeros(1, 1, 6)}
    layer = type("Layer", (), {"is_sliding": False})()
    observer = ReconstructionObserver(sinks=1, start=3, end=5, scores=scores)
    observer.record(0, layer, torch.zeros(1, 2, 2, 4), torch.randn(1, 1, 8, 4), 1.0)
    torch.testing.assert_close(scores[0], torch.tensor([[[0, 0, 0, 1 / 4, 1 / 4, 0]]]))


def test_baseline_and_full_cache_unchanged_beside_kvzip(tiny, prompt):
    """The second pass runs on a shared copy: the baseline's tokens and logits must be exactly those of a run
    without kvzip, and the full cache must not grow (catches a pass that writes into the prefilled cache)."""
    alone, _ = run_sample(tiny.model, prompt, [], 6, set())
    beside, (out,) = run_sample(tiny.model, prompt, [Variant(policy("kvzip", 0.25))], 6, set())
    assert beside.tokens == alone.tokens
    for a, b in zip(beside.logits, alone.logits, strict=True):
        assert torch.equal(a, b)
    pol = policy("kvzip", 0.25, chunk_size=40)
    context = prompt.ids[:, : prompt.n_context]
    full, obs = prefill(tiny.model, context, [pol])
    before = (kv_bytes(full), full.get_seq_length(), [layer.keys.clone() for layer in full.layers])
    reconstruction(tiny.model, full, context, prompt.repeat, [pol], obs)
    assert (kv_bytes(full), full.get_seq_length()) == before[:2]
    assert all(torch.equal(layer.keys, k) for layer, k in zip(full.layers, before[2], strict=True))


def test_reconstruct_seconds_recorded_for_kvzip_variants_only(tiny, prompt):
    """The pass's time goes into each kvzip variant's seconds (one pass per distinct setting) and nowhere else."""
    variants = [Variant(policy("kvzip", 0.25)), Variant(policy("kvzip", 0.5)), Variant(policy("snapkv", 0.25))]
    base, (a, b, snap) = run_sample(tiny.model, prompt, variants, 2, set())
    assert a.seconds["reconstruct"] > 0 and a.seconds["reconstruct"] == b.seconds["reconstruct"]
    assert "reconstruct" not in snap.seconds and "reconstruct" not in base.seconds


def test_compress_once_modes_and_bad_params_are_config_errors():
    """kvzip scores the whole prompt once: decode=true, a chunked prefill and impossible parameters are refused."""
    with pytest.raises(ConfigError, match="compresses once"):
        policy("kvzip", 0.25, decode=True).validate(1024)
    with pytest.raises(ConfigError, match="does not support a chunked prefill"):
        Variant(policy("kvzip", 0.25), chunk=64).validate()
    with pytest.raises(ConfigError, match="n_sink"):
        policy("kvzip", 0.25, n_sink=-1).validate(1024)
    with pytest.raises(ConfigError, match="chunk_size"):
        policy("kvzip", 0.25, chunk_size=0).validate(1024)


def test_lm_eval_route_refuses_kvzip():
    """lm-eval's requests carry no chat template or context boundary to build the repeat prompt from: refused with
    the reason, before any request runs."""
    pytest.importorskip("lm_eval")
    from evalkit.lmeval.evaluate import evaluate

    with pytest.raises(ConfigError, match="reconstruction pass"):
        evaluate(None, None, [Variant(policy("kvzip", 0.25))])
