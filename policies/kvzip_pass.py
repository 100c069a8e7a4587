"""KVzip's reconstruction pass (policies/kvzip.py) in one forward, its scores taken from the attention it computes.

The pass is KVzip's own observation (`Reconstruction`): the engine runs it after the prefill, as it runs any
observation's second pass, and the policy reads its scores back by the same object.

The reference (kvpress's KVzipPress, after snu-mllab/KVzip) runs one forward per chunk of the context: each reads a
repeat prompt and the chunk over the prefilled cache, and a second QK^T over the sinks, the chunk's cached keys and the
pass's own keys gives the scores. Here every chunk's pass is one block of a single forward: the blocks lie side by side
in the input, each at the positions its own pass would have (the cache length onwards), and the cache layers of the pass
(`ReconstructionLayer`) attend for the model: each block's queries over the prefilled keys, read in place (never copied
or grown), and over the block's own keys, causally; no block sees another. The probabilities of that attention are
computed once per query chunk (as for H2O, evalkit.attention.fused), and the scores come from the same logits: each
query's softmax restricted to the sinks, the chunk's keys and its own keys, its largest value per key kept as the pass
goes (the max over queries and over the query heads of a KV group). Nothing of the size of the cache is allocated per
chunk: a query chunk's scores (bounded by evalkit.attention.fused.CHUNK_ELEMENTS) and the scores kept per key.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from evalkit.attention.fused import query_chunk
from evalkit.attention.observation import Attended, Observation, attention_inputs
from evalkit.attention.sdpa import causal_tail_mask, observe, require_named, sdpa

PREVIOUS_IDS = 8  # the ids of the previous chunk that a later chunk's repeat prompt quotes (kvpress: prev_postfix_size)


@dataclass
class RawIds:
    """The repeat prompt of a prompt made from raw ids (no chat template; the tasks build theirs, with the same
    fields): every prefilled token reconstructed, with no instruction."""

    start: int = 0  # ids[:, :start] are the template's opening: not reconstructed
    first: list[int] = field(default_factory=list)  # the first chunk's instruction
    part: list[int] = field(default_factory=list)  # a later chunk's, before the previous chunk's last ids
    suffix: list[int] = field(default_factory=list)  # the end of the user turn and the start of the answer


@dataclass(frozen=True)
class Reconstruction(Observation):
    """Per full-attention layer, (B, Hkv, n_context): the most attention each prefilled key receives while the model,
    over the full cache, reads the repeat prompt and then the context again, `chunk` context tokens per pass, each
    softmax over the first `sinks` keys, the chunk's and the pass's own; `plus`: KVzip+'s normalisation."""

    sinks: int
    chunk: int
    plus: bool = False
    pass_name: ClassVar[str] = "reconstruct"

    def second_pass(self, model: torch.nn.Module, full: Cache, context: Tensor, prompt) -> dict[int, Tensor]:
        return reconstruct(model, full, context, prompt or RawIds(), self.sinks, self.chunk, self.plus)


def pass_inputs(context: Tensor, repeat, chunk: int) -> tuple[Tensor, Tensor, list[Block]]:
    """The ids (1, L) of every chunk's pass side by side, their positions (1, L) (each block from the context length
    on, where its own pass would start) and the blocks. The chunk [lo, hi) of the context after the template's opening
    (`repeat.start`) is read after `repeat.first` (the first chunk) or `repeat.part` and the previous chunk's last 8
    ids, then `repeat.suffix` (`repeat`: the task's repeat prompt, or RawIds)."""
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
    repeat,
    sinks: int,
    chunk: int,
    plus: bool = False,
) -> dict[int, Tensor]:
    """KVzip's second pass: per full-attention layer, (B, Hkv, n_context) the most attention each prefilled key
    receives while the model, over the full cache, reads the repeat prompt and then the context again, `chunk`
    context tokens per pass (the first `repeat.start` tokens, the template's opening, are not repeated and score 0);
    `plus`: KVzip+'s normalisation. Every chunk's pass is one block of a single forward, which reads `full` in place
    and leaves it unchanged."""
    ids, positions, blocks = pass_inputs(context, repeat, chunk)
    cache, scores = reconstruction_cache(full, blocks, sinks)
    if blocks:
        with hidden_norms(model, cache) if plus else nullcontext():
            run_pass(model, cache, ids, positions)
    return scores


@torch.inference_mode()
def run_pass(model: torch.nn.Module, cache: Cache, ids: Tensor, positions: Tensor) -> None:
    """The pass's one forward: every block of `ids` at its `positions`, attended by the layers of `cache` (built by
    `reconstruction_cache`), which fill their scores."""
    model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1, **observe(None, cache))


@dataclass(frozen=True)
class Block:
    """One chunk's pass inside the single forward: queries [start, end) of the input reconstruct context [lo, hi)."""

    start: int
    end: int
    lo: int
    hi: int


def block_attention(
    query: Tensor,
    past: tuple[Tensor, Tensor],
    own: tuple[Tensor, Tensor],
    scaling: float,
    scored: tuple[int, int, int] | None = None,
    weights: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """One block's attention: query (B, Hq, m, D) over the past keys and values (B, Hkv, P, D), all earlier than the
    block, and its own (B, Hkv, m, D), causally; grouped query heads share a KV head.

    `scored` (sinks, lo, hi): also returns (B, Hkv, hi - lo), for each past key in [lo, hi), the most attention it
    gets from any query and any query head of its group, each query's softmax taken over the first `sinks` past keys,
    the keys [lo, hi) and the own keys it sees. `weights` (KVzip+): the norm of each query's hidden state (B, m), which
    divides those probabilities, and of each scored key's value through the output projection of each query head
    (B, Hkv, G, hi - lo), which multiplies them. Returns the output (B, m, Hq, D) in the query's dtype, as
    transformers' attention functions do, and the scores or None. (A sliding-window layer's blocks, which are not
    scored, attend through `ReconstructionLayer.within_window`.)"""
    (past_k, past_v), (own_k, own_v) = past, own
    b, hq, m, _ = query.shape
    hkv, p = past_k.shape[1], past_k.shape[2]
    group = hq // hkv
    chunk = query_chunk(1, group, p + m)
    out = torch.empty(b, hkv, group, m, past_v.shape[-1], dtype=torch.float32, device=query.device)
    best = None if scored is None else torch.zeros(b, hkv, scored[2] - scored[1], device=query.device)
    scratch = torch.empty(group * chunk * (p + m), device=query.device)  # one chunk's logits, reused
    queries = query.view(b, hkv, group, m, -1)
    for i in range(b):
        for h in range(hkv):
            head = [queries[i, h].float() * scaling] + [x[i, h].float() for x in (past_k, past_v, own_k, own_v)]
            w = None if weights is None else (weights[0][i], weights[1][i, h])
            kept = None if best is None else best[i, h]
            block_head(head, scratch, chunk, out[i, h], kept, scored, w)
    return out.view(b, hq, m, -1).transpose(1, 2).to(query.dtype).contiguous(), best


def block_head(
    head: list[Tensor],
    scratch: Tensor,
    chunk: int,
    out: Tensor,
    best: Tensor | None,
    scored: tuple[int, int, int] | None,
    weights: tuple[Tensor, Tensor] | None,
) -> None:
    """`block_attention` for one KV head: queries (G, m, D), already scaled, past and own keys and values (P or m, D);
    writes the output (G, m, D) into `out` and raises `best` (hi - lo,) to the scores, chunk by chunk of queries:
    one set of logits and one softmax per chunk serve both."""
    queries, past_k, past_v, own_k, own_v = head
    group, m, d = queries.shape
    p = past_k.shape[0]
    past_t, own_t = past_k.t(), own_k.t()
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=queries.device).triu(1)
    for start in range(0, m, chunk):
        end = min(start + chunk, m)
        n = end - start
        rows = queries[:, start:end].reshape(group * n, d)
        probs = scratch[: group * n * (p + end)].view(group * n, p + end)
        chunk_logits(rows, (past_t, own_t), (start, end), upper, probs)
        torch.softmax(probs, dim=-1, out=probs)  # in place: the output's probabilities, over every key it sees
        out[:, start:end] = (probs[:, :p] @ past_v + probs[:, p:] @ own_v[:end]).view(group, n, -1)
        if best is None:
            continue

        def exact(low: Tensor, rows=rows, start=start, end=end) -> Tensor:
            logits = torch.empty(rows.shape[0], p + end, device=rows.device)
            return chunk_logits(rows, (past_t, own_t), (start, end), upper, logits)[low]

        norms = None if weights is None else (weights[0][start:end], weights[1])
        got = subset_probs(probs, p, scored, exact).view(group, n, -1)  # (G, n, hi - lo)
        if norms is not None:  # KVzip+
            got = got / norms[0][None, :, None] * norms[1][:, None, :]
        torch.maximum(best, got.amax(dim=(0, 1)), out=best)


def chunk_logits(
    rows: Tensor, keys_t: tuple[Tensor, Tensor], span: tuple[int, int], upper: Tensor, out: Tensor
) -> Tensor:
    """Into `out` (G * n, P + end): the scaled queries `rows` (G * n, D), queries [start, end) of a block, against
    the past keys and the block's own keys up to `end` (both transposed, (D, P) and (D, m)); -inf where a query
    cannot see the key (an own key after it)."""
    (past_t, own_t), (start, end) = keys_t, span
    p, n = past_t.shape[1], end - start
    torch.matmul(rows, past_t, out=out[:, :p])
    torch.matmul(rows, own_t[:, :end], out=out[:, p:])
    grouped = out.view(-1, n, p + end)
    grouped[..., p + start :].masked_fill_(upper[:n, :n], float("-inf"))  # only the diagonal block has later keys
    return out


def in_window(start: int, end: int, past: int, window: int, device: torch.device) -> Tensor:
    """(n, past + end) bool: for the block's queries [start, end) (query j at position past + j, counting from the
    first past key), the keys less than `window` positions back."""
    q_pos = torch.arange(start, end, device=device)[:, None] + past
    k_pos = torch.arange(past + end, device=device)[None, :]
    return k_pos > q_pos - window


TINY = 1e-30  # below this share of a query's probability, the subset's is recomputed from logits (float32's floor)


def subset_probs(probs: Tensor, past: int, scored: tuple[int, int, int], exact) -> Tensor:
    """(rows, hi - lo): each row's probabilities of the keys [lo, hi) renormalised over the subset KVzip scores with
    (the first `sinks` keys, [lo, hi), and the own keys, the columns from `past` on): the softmax over the subset
    alone, taken from the full softmax `probs` (rows, past + own) without a second exponential. A row whose subset
    holds less than TINY of its probability (where float32 would lose the ratio) is recomputed from its logits,
    `exact(rows)` (the rows' logits over every key)."""
    sinks, lo, hi = scored
    share = probs[:, :sinks].sum(dim=-1) + probs[:, lo:hi].sum(dim=-1) + probs[:, past:].sum(dim=-1)
    got = probs[:, lo:hi] / share[:, None]
    low = (share < TINY).nonzero().flatten()
    if low.numel():
        logits = exact(low)
        subset = torch.cat([logits[:, :sinks], logits[:, lo:hi], logits[:, past:]], dim=-1).softmax(dim=-1)
        got[low] = subset[:, sinks : sinks + hi - lo]
    return got


class ReconstructionLayer(DynamicLayer):
    """A prefilled cache layer as KVzip's pass reads it: its keys and values stay as they are (the pass's own keys
    are held for one forward only), and it attends for the model (`attends`, evalkit.attention.sdpa): each block of
    the input over the prefilled keys and its own, never another block's. A full-attention layer scores its keys as it
    goes (`scores`, (B, Hkv, prefilled), the running max); a sliding-window layer only attends, within its window
    (`within_window`: SDPA, band by band)."""

    is_compileable = False

    def __init__(self, full: DynamicLayer, blocks: list[Block], sinks: int, scores: Tensor | None):
        super().__init__()
        self.keys, self.values = full.keys, full.values
        self.seen = full.get_seq_length()
        self.is_sliding = getattr(full, "is_sliding", False)
        self.window = getattr(full, "sliding_window", None) if self.is_sliding else None
        self.blocks, self.sinks, self.scores = blocks, sinks, scores
        self.hidden_norms: Tensor | None = None  # KVzip+: (B, L) norms of the hidden states entering the attention
        self.own: tuple[Tensor, Tensor] | None = None
        self.device, self.dtype, self.is_initialized = full.keys.device, full.keys.dtype, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        require_named(kwargs, self)
        self.own = (key_states, value_states)
        return key_states, value_states  # the blocks attend in `attend`

    def attends(self, query: Tensor) -> bool:
        return True

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # `attend` masks each block itself, so the mask transformers builds for the whole input is never read: sized
        # (input x 0 keys) it is empty. Sized (input x input), a sliding layer's was built in full (1 GiB of booleans
        # at 32k tokens), which made the pass's peak memory 1.27x the plain prefill's at 32k
        return 0, 0

    def attend(self, module, query: Tensor, attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
        """The pass's attention for every block (`block_attention`), its scores kept as the running max."""
        scaling = kwargs.get("scaling") or module.scaling
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], self.own[1].shape[-1])
        for blk in self.blocks:
            own = (self.own[0][:, :, blk.start : blk.end], self.own[1][:, :, blk.start : blk.end])
            q = query[:, :, blk.start : blk.end]
            if self.window is not None:  # a sliding layer only attends (no scores): SDPA, band by band
                out[:, blk.start : blk.end] = self.within_window(module, q, own, scaling)
                continue
            scored = None if self.scores is None else (min(self.sinks, blk.lo), blk.lo, blk.hi)
            weights = None
            if scored is not None and self.hidden_norms is not None:
                weights = (
                    self.hidden_norms[:, blk.start : blk.end],
                    value_norms(module, self.values[:, :, blk.lo : blk.hi]),
                )
            got, best = block_attention(q, (self.keys, self.values), own, scaling, scored, weights)
            out[:, blk.start : blk.end] = got
            if best is not None:
                held = self.scores[..., blk.lo : blk.hi]
                self.scores[..., blk.lo : blk.hi] = torch.maximum(held, best)
        self.own = None
        return out, None

    def within_window(self, module, query: Tensor, own: tuple[Tensor, Tensor], scaling: float) -> Tensor:
        """A sliding layer's attention for one block, as `block_attention` computes it without scores: the queries
        over the held keys (the last P before the block) and the block's own, causally, within the window; through
        SDPA, band by band over the concatenated keys (evalkit.attention.sdpa.sdpa)."""
        keys, values = (torch.cat(pair, dim=2) for pair in zip((self.keys, self.values), own, strict=True))
        m, p = query.shape[2], self.keys.shape[2]
        mask = causal_tail_mask(m, p + m, query.device) & in_window(0, m, p, self.window, query.device)
        got, _ = sdpa(module, query, keys, values, mask, scaling=scaling, sliding_window=self.window)
        return got


class ReadOnlyLayer(DynamicLayer):
    """A full cache layer read in place by a pass of transformers' own attention (KVgrad's gradients, KVCompose's
    repeat): a forward sees its keys and values and the new ones, and leaves it as it was (nothing is appended)."""

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


READ_CHUNK = 256  # queries of a pass over a ReadOnlyLayer whose attention is computed at once, per query head


def pass_probs(at: Attended, keys: Tensor, start: int, end: int) -> Tensor:
    """(B, Hq, end - start, Tk) float32: the softmax of a pass's queries start .. end - 1 over every key, its queries
    being the last of the keys (a pass over a ReadOnlyLayer): each sees the cache and the pass's own keys up to its
    own (causal_tail_mask). `keys`: `at.key` repeated over each KV group's query heads, in float32."""
    logits = (at.query[:, :, start:end].float() * at.scaling) @ keys.transpose(-1, -2)
    hidden = ~causal_tail_mask(at.query.shape[2], keys.shape[-2], keys.device)[..., start:end, :]
    return logits.masked_fill(hidden, -math.inf).softmax(dim=-1)


def value_norms(module: torch.nn.Module, values: Tensor) -> Tensor:
    """(B, Hkv, G, T): ||W_O v|| for each value (B, Hkv, T, D) and each query head of its group, where W_O is the slice
    of the output projection (`module.o_proj`) that reads that head: the size of what the value writes into the
    residual stream (KVzip+). Computed as sqrt(v^T (W^T W) v), never materialising W_O v."""
    weight = module.o_proj.weight.float()  # (hidden, Hq * D)
    b, hkv, t, d = values.shape
    heads = weight.view(weight.shape[0], -1, d)  # (hidden, Hq, D)
    gram = torch.einsum("jhi,jhk->hik", heads, heads).view(hkv, -1, d, d)  # (Hkv, G, D, D)
    v = values.float()
    quad = torch.einsum("bhti,hgik,bhtk->bhgt", v, gram, v)
    return quad.clamp(min=0).sqrt()


def reconstruction_cache(full: Cache, blocks: list[Block], sinks: int) -> tuple[Cache, dict[int, Tensor]]:
    """The pass's cache over `full` (left unchanged) and the scores its full-attention layers fill: per layer,
    (B, Hkv, prefilled) zeros to start with (the template's opening, never reconstructed, stays 0)."""
    layers, scores = [], {}
    for i, layer in enumerate(full.layers):
        if not getattr(layer, "is_sliding", False):
            scores[i] = torch.zeros(layer.keys.shape[:3], dtype=torch.float32, device=layer.keys.device)
        layers.append(ReconstructionLayer(layer, blocks, sinks, scores.get(i)))
    return Cache(layers=layers), scores


def hidden_norms(model: torch.nn.Module, cache: Cache) -> AbstractContextManager[None]:
    """KVzip+: within the block, every attention layer of `model` records on its layer of `cache` the norm of the hidden
    states it receives."""

    def record(layer_idx: int, hidden: Tensor) -> None:
        cache.layers[layer_idx].hidden_norms = hidden.float().norm(dim=-1)  # (B, L)

    return attention_inputs(model, record)
