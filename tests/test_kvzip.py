"""KVzip (Kim et al. 2025, arXiv:2505.23416): scores from a second pass that reconstructs the context, checked against
plain eager attention and against values worked by hand; its pass leaves the baseline and the full cache untouched."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.engine.engine import Variant, prefill, reconstruction, run_sample
from evalkit.errors import ConfigError
from evalkit.kv.cache import compress, kv_bytes, select
from evalkit.kv.quantized import QuantSpec
from evalkit.policies import LayerView
from evalkit.policies.kvzip import KVzip
from evalkit.policies.kvzip_pass import Reconstruction, block_attention
from evalkit.tasks import Sample
from evalkit.tasks.prompt import Repeat, build_prompt
from tests.conftest import ROOT, policy

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


def norms_entering_attention(eager, seq):
    """Per layer: the hidden states entering the attention (the layer's input norm of its residual stream), as
    transformers' eager forward computes them, and the values they give (B, Hkv, L, D), for KVzip+'s norms."""
    with torch.inference_mode():
        states = eager(input_ids=seq, output_hidden_states=True).hidden_states  # per layer input (1, L, hidden)
    out = []
    for layer, h in zip(eager.model.layers, states, strict=False):
        x = layer.input_layernorm(h)
        attn = layer.self_attn
        v = attn.v_proj(x).view(1, seq.shape[1], -1, attn.head_dim).transpose(1, 2)
        out.append((x.norm(dim=-1)[0], v))
    return out


def value_output_norm(attn, v, group):
    """(Hkv, G, T): ||W_O,h v|| with W_O,h the columns of o_proj that read query head h = kv * G + g, multiplied
    out (the plain definition)."""
    d = attn.head_dim
    w = attn.o_proj.weight  # (hidden, Hq * D)
    heads = [
        [w[:, (kv * group + g) * d : (kv * group + g + 1) * d] @ v[0, kv].T for g in range(group)]
        for kv in range(v.shape[1])
    ]
    return torch.stack([torch.stack([m.norm(dim=0) for m in row]) for row in heads])


def chunk_sequences(context, repeat, chunk, prev=8) -> list[tuple[int, int, torch.Tensor]]:
    """Per chunk [lo, hi) of the context after the template opening: lo, hi and the sequence [context, repeat prompt
    (the first instruction, or the later one with the previous chunk's last `prev` ids), the chunk], as kvpress
    builds each chunk's pass."""
    n = context.shape[1]
    los = list(range(repeat.start, n, chunk))
    out = []
    for i, lo in enumerate(los):
        hi = min(lo + chunk, n)
        quote = context[0, max(los[i - 1], lo - prev) : lo].tolist() if i else []
        head = (repeat.part + quote if i else repeat.first) + repeat.suffix
        out.append((lo, hi, torch.cat([context, torch.tensor([head]), context[:, lo:hi]], dim=1)))
    return out


def eager_scores(eager, context, repeat, sinks, chunk, plus=False, prev=8):
    """The reconstruction scores from transformers' eager attention matrices over the whole sequence [context,
    repeat prompt, chunk of the context], one sequence per chunk, written from the paper and kvpress's description:
    per chunk [lo, hi) of the context after the template opening, each query of the repeat part attends over the
    first min(sinks, lo) keys, the chunk's keys and the repeat part's keys (the eager probabilities renormalised over
    those keys: the softmax over them alone); KVzip+ (`plus`) divides each query's row by the norm of its hidden state
    entering the attention and multiplies each key's column by ||W_O v|| of its query head; a key's score is its
    largest value from any of those queries and any query head of its KV group. Tokens before `repeat.start` score
    0. Returns per layer (Hkv, n); sliding-window layers (hybrid models) are left out."""
    n = context.shape[1]
    cfg = eager.config
    hkv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    full = [
        i
        for i, t in enumerate(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        if t == "full_attention"
    ]
    out = {i: torch.zeros(hkv, n) for i in full}
    for lo, hi, seq in chunk_sequences(context, repeat, chunk, prev):
        with torch.inference_mode():
            attentions = eager(input_ids=seq, output_attentions=True).attentions  # per layer (1, Hq, L, L)
        norms = norms_entering_attention(eager, seq) if plus else None
        s = min(sinks, lo)
        cols = list(range(s)) + list(range(lo, hi)) + list(range(n, seq.shape[1]))
        for layer in full:
            p = attentions[layer][0][:, n:][:, :, cols]  # (Hq, repeat queries, subset)
            p = p / p.sum(-1, keepdim=True)
            chunk_cols = p[:, :, s : s + hi - lo]  # the chunk's keys
            if plus:
                h_norm, v = norms[layer]
                wov = value_output_norm(eager.model.layers[layer].self_attn, v[:, :, lo:hi], group)
                chunk_cols = chunk_cols / h_norm[n:][None, :, None] * wov.reshape(-1, hi - lo)[:, None, :]
            per_head = chunk_cols.amax(dim=1)  # (Hq, hi - lo): max over the queries
            out[layer][:, lo:hi] = per_head.view(hkv, -1, hi - lo).amax(dim=1)  # and over each group's heads
    return out


@pytest.mark.parametrize("plus", [False, True], ids=["kvzip", "kvzip+"])
@pytest.mark.parametrize("chunk_size", [2048, 40], ids=["one-pass", "chunks-of-40"])
def test_scores_equal_eager_reconstruction(tiny, eager, prompt, chunk_size, plus):
    """evalkit's pass (every chunk a block of one forward, attended by the pass's cache layers) must give the scores
    eager attention gives over [context, repeat prompt, context chunk], one sequence per chunk. Catches a softmax
    over the whole cache instead of sinks + chunk + own keys, a sum or mean instead of the max, a missing group max,
    a wrong repeat prompt or quote of the previous chunk, a block that sees another block or is at the wrong
    positions, reconstructing the template opening, and KVzip+'s norms taken on the wrong side or the wrong head."""
    pol = policy("kvzip", 0.25, chunk_size=chunk_size, plus=plus)
    context = prompt.ids[:, : prompt.n_context]
    full, obs = prefill(tiny.model, context, [pol])
    reconstruction(tiny.model, full, context, prompt.repeat, [pol], obs)
    want = eager_scores(eager, context, prompt.repeat, 4, chunk_size, plus)
    key = Reconstruction(4, chunk_size, plus)
    for layer, ref in want.items():
        torch.testing.assert_close(obs[layer][key][0], ref, rtol=1e-4, atol=1e-6)
    assert (context.shape[1] - prompt.repeat.start) > 2 * 40, "the 40-token chunks must split the context twice"


@pytest.mark.parametrize("layerwise", [False, True], ids=["global", "layerwise"])
def test_kept_tokens_are_the_top_scores_over_all_layers_or_per_layer(tiny, eager, prompt, layerwise):
    """The paper's budget: k x Hkv x layers tokens in all (k = ceil(0.25 n)), the 4 sinks of every head first, then
    the best reference scores of all layers and heads together (`layerwise`: of each layer's heads together, k x Hkv
    per layer). Heads and layers then hold different counts; a uniform top-k per head fails both."""
    pol = policy("kvzip", 0.25, layerwise=layerwise)
    context = prompt.ids[:, : prompt.n_context]
    n, hkv = context.shape[1], tiny.model.config.num_key_value_heads
    k = math.ceil(0.25 * n)
    want = eager_scores(eager, context, prompt.repeat, 4, 2048)
    _, cache = compressed_with(tiny, context, prompt, pol)
    kept = {i: [set(h.tolist()) - {-1} for h in cache.layers[i].positions[0]] for i in want}
    assert all(set(range(4)) <= head for heads in kept.values() for head in heads)
    for scope in [list(want)] if not layerwise else [[i] for i in want]:
        assert sum(len(head) for i in scope for head in kept[i]) == k * hkv * len(scope)
        scores = [
            (want[i][h, p].item(), p in head) for i in scope for h, head in enumerate(kept[i]) for p in range(4, n)
        ]
        assert min(s for s, held in scores if held) >= max(s for s, held in scores if not held) - 1e-6
    counts = [len(head) for heads in kept.values() for head in heads]
    assert len(set(counts)) > 1, "heads keep different counts"


def compressed_with(tiny, context, prompt, pol):
    full, obs = prefill(tiny.model, context, [pol])
    reconstruction(tiny.model, full, context, prompt.repeat, [pol], obs)
    return full, compress(full, pol, obs)


def view_of(scores: list[list[float]], layer: int = 0) -> LayerView:
    """A layer whose reconstruction scores are given by hand (Hkv heads x T tokens), positions 0..T-1."""
    s = torch.tensor(scores).unsqueeze(0)
    k = torch.zeros(*s.shape, 1)
    return LayerView(
        layer,
        2,
        s.shape[-1],
        k,
        k,
        torch.arange(s.shape[-1]).expand(s.shape),
        observations={Reconstruction(1, 2048): s},
    )


def test_global_and_layerwise_choices_by_hand():
    """Two layers of two heads, 5 tokens each, one sink. Scores (token 0 is the sink):
    layer 0: head 0 [0, .9, .8, .1, .1], head 1 [0, .2, .25, .3, .35]; layer 1: head 0 [0, .7, .15, .12, .11],
    head 1 [0, .6, .5, .14, .13].
    k = 2 per head (8 in all): global keeps the 4 sinks and .9 .8 .7 .6; layerwise (4 per layer) the layer's 2 sinks
    and its 2 best, the same here: layer 0 keeps 0 1 2 | 0, layer 1 0 1 | 0 1. k = 3 (12): global adds .5 .35 .3 .25:
    0 1 2 | 0 2 3 4 and 0 1 | 0 1 2; layerwise (6 per layer): layer 0 .9 .8 .35 .3 -> 0 1 2 | 0 3 4, layer 1 .7 .6 .5
    .15 -> 0 1 2 | 0 1 2. A uniform top-k per head keeps k in every head."""
    views = {
        0: view_of([[0, 0.9, 0.8, 0.1, 0.1], [0, 0.2, 0.25, 0.3, 0.35]], 0),
        1: view_of([[0, 0.7, 0.15, 0.12, 0.11], [0, 0.6, 0.5, 0.14, 0.13]], 1),
    }
    want = {
        (2, False): ([[0, 1, 2], [0, -1, -1]], [[0, 1], [0, 1]]),
        (2, True): ([[0, 1, 2], [0, -1, -1]], [[0, 1], [0, 1]]),
        (3, False): ([[0, 1, 2, -1], [0, 2, 3, 4]], [[0, 1, -1], [0, 1, 2]]),
        (3, True): ([[0, 1, 2], [0, 3, 4]], [[0, 1, 2], [0, 1, 2]]),
    }
    for (k, layerwise), (layer0, layer1) in want.items():
        policy = KVzip(budget=k, n_sink=1, layerwise=layerwise)
        assert policy.ranks_across_layers is not layerwise
        got = select(policy, views, {0: k, 1: k}, policy.ranks_across_layers)
        assert (got[0].tolist(), got[1].tolist()) == ([layer0], [layer1]), (k, layerwise)


def test_block_attention_max_over_queries_and_group_by_hand():
    """One KV head shared by two query heads, 1-d past keys [ln 3, 0] before a block of two queries whose own keys
    are 0, scale 1, no sinks, the scored chunk [0, 2). Head 0's queries are 1: query 0 sees ln3, 0, 0 -> 3/5, 1/5,
    1/5; query 1 sees ln3, 0, 0, 0 -> 1/2, 1/6, 1/6, 1/6. Head 1's queries are 0: uniform, 1/3 (query 0) and 1/4
    (query 1). Key 0: max(3/5, 1/2, 1/3, 1/4) = 3/5; key 1: max(1/5, 1/6, 1/3, 1/4) = 1/3, from head 1's first query.
    A sum over the queries, head 0 alone, or a query seeing a later own key (1/4 for head 1) gives other values. The
    output is the same probabilities applied to the values: past values 1 and 2, own values 0."""
    query = torch.tensor([[1.0, 1.0], [0.0, 0.0]]).view(1, 2, 2, 1)  # (B, Hq, m, D)
    past = (torch.tensor([math.log(3), 0.0]).view(1, 1, 2, 1), torch.tensor([1.0, 2.0]).view(1, 1, 2, 1))
    own = (torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1))
    out, best = block_attention(query, past, own, 1.0, scored=(0, 0, 2))
    torch.testing.assert_close(best, torch.tensor([[[3 / 5, 1 / 3]]]))
    # head 0: 3/5 + 2/5, 1/2 + 2/6; head 1: 1/3 + 2/3, 1/4 + 2/4 -> (B, m, Hq, D)
    want = torch.tensor([[1.0, 1.0], [1 / 2 + 1 / 3, 3 / 4]]).view(1, 2, 2, 1)
    torch.testing.assert_close(out, want)


def test_scores_softmax_spans_sinks_chunk_and_own_keys_only_by_hand():
    """Six past keys, one sink, the chunk [3, 5), a block of two queries whose logits are all 0: each query's score
    softmax is uniform over key 0, keys 3 and 4 and the own keys it sees: 1/4 (first query: 3 past + its own) and 1/5,
    so keys 3 and 4 score 1/4. Over the whole cache it would be 1/7 (and the output's softmax is over all 7 or 8)."""
    past = (torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    own = (torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    _, best = block_attention(torch.zeros(1, 2, 2, 4), past, own, 1.0, scored=(1, 3, 5))
    torch.testing.assert_close(best, torch.tensor([[[1 / 4, 1 / 4]]]))


def test_scores_stay_exact_when_a_key_outside_the_subset_takes_all_the_attention():
    """As above with 1-d keys, but key 2 (outside the sinks, the chunk and the own keys) has logit 200 for a query of
    1: the output's softmax puts e^-200 (0 in float32) on every other key, so the subset's share cannot be taken from
    it; the scores must still be the softmax over the subset alone: logits 0 for keys 0, 3, 4 and the own keys ->
    1/4 and 1/5, max 1/4 (and the output is key 2's value)."""
    past_k = torch.tensor([0.0, 0.0, 200.0, 0.0, 0.0, 0.0]).view(1, 1, 6, 1)
    past_v = torch.arange(6.0).view(1, 1, 6, 1)
    own = (torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1))
    out, best = block_attention(torch.ones(1, 1, 2, 1), (past_k, past_v), own, 1.0, scored=(1, 3, 5))
    torch.testing.assert_close(best, torch.tensor([[[1 / 4, 1 / 4]]]))
    torch.testing.assert_close(out, torch.full((1, 2, 1, 1), 2.0))


@pytest.mark.parametrize("chunk", [24, 64])
def test_one_forward_on_a_hybrid_model_matches_eager_per_chunk_passes(chunk):
    """Gemma 3 (sliding-window layers beside a global one): the blocks of the single forward must attend within each
    sliding layer's window as a pass of their own would; the global layer's scores equal eager attention's. A block
    gives a sliding layer 15 held keys and its own (29 or 69), over 2 windows of 16: SDPA band by band."""
    gemma = models.load(model_spec(OmegaConf.load(ROOT / "conf" / "model" / "tiny-random-gemma3.yaml")), "cpu")
    g = torch.Generator().manual_seed(3)
    context = torch.randint(3, 200, (1, 70), generator=g)
    rep = Repeat(start=3, first=[11, 12, 13], part=[14, 15], suffix=[16, 17])
    pol = policy("kvzip", 0.25, chunk_size=chunk)
    full, obs = prefill(gemma.model, context, [pol])
    reconstruction(gemma.model, full, context, rep, [pol], obs)
    eager = copy.deepcopy(gemma.model)
    eager.set_attn_implementation("eager")
    want = eager_scores(eager, context, rep, 4, chunk)
    assert list(want) == [2] and set(obs) == {2}
    torch.testing.assert_close(obs[2][Reconstruction(4, chunk)][0], want[2], rtol=1e-4, atol=1e-6)


def test_baseline_and_full_cache_unchanged_beside_kvzip(tiny, prompt):
    """The second pass reads the prefilled cache in place: the baseline's tokens and logits must be those of a run
    without kvzip (within float rounding: beside kvzip the baseline decodes in a batch of two: engine.decode), and
    the full cache must not change or grow (catches a pass that writes into the prefilled cache)."""
    alone, _ = run_sample(tiny.model, prompt, [], 6, set())
    beside, (out,) = run_sample(tiny.model, prompt, [Variant(policy("kvzip", 0.25))], 6, set())
    assert beside.tokens == alone.tokens
    for a, b in zip(beside.logits, alone.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
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
    with pytest.raises(ConfigError, match="quant=none"):  # heads keep different counts
        Variant(policy("kvzip", 0.25), quant=QuantSpec(name="int8", bits=8)).validate()


def test_lm_eval_route_refuses_kvzip():
    """lm-eval's requests carry no chat template or context boundary to build the repeat prompt from: refused with
    the reason, before any request runs."""
    pytest.importorskip("lm_eval")
    from evalkit.lmeval.evaluate import evaluate

    with pytest.raises(ConfigError, match="reconstruction pass"):
        evaluate(None, None, [Variant(policy("kvzip", 0.25))])


def test_lm_eval_refuses_a_variant_whose_observation_needs_a_pass_over_the_prompt():
    """lm-eval's requests are raw ids: KVzip's pass (an observation with a second pass) cannot build its repeat prompt
    there, so such a variant is refused, named; a variant whose observations are recorded in the prefill is not."""
    from evalkit.lmeval.evaluate import refuse_reconstruction

    with pytest.raises(ConfigError, match=r"kvzip@0.25: task=lm_eval does not run KVzip's reconstruction pass"):
        refuse_reconstruction([Variant(policy("snapkv", 0.25)), Variant(policy("kvzip", 0.25))])
    refuse_reconstruction([Variant(policy("snapkv", 0.25)), Variant(policy("expected_attention", 0.25))])
