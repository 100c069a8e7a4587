"""Greedy decoding of several caches at once: the baseline and every variant of a sample in one batch.

All of a sample's variants decode the same question after the same context, so every forward of the decode can run
them as one batch: the model's projections and MLPs read their weights once for all rows, which is most of a decode
step's cost on a small model. Attention is the one part that differs per row: each row keeps its own cache (dense,
ragged, quantized, evicting while decoding), and `BatchedLayer` lets each row attend over its own layer, observed as a
lone decode would be, so H2O's running mass, window queries, eviction after every forward, bytes and peaks are
exactly those of decoding the row alone (`greedy`), which tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from evalkit.attention.observation import StepRecorder
from evalkit.attention.sdpa import causal_tail_mask, evalkit_sdpa, observe, require_named
from evalkit.kv.cache import deployed_bytes, kv_bytes


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)
    logits: list[Tensor] = field(default_factory=list)  # (vocab,) float32 logits that chose each generated token
    peak_bytes: int = 0  # largest KV bytes held at any point of the decode
    peak_deployed: int = 0  # the same, as a deployment holds them (cache.deployed_bytes)

    def saw(self, cache: Cache) -> None:
        """Count what `cache` holds now (after a forward, before any eviction) towards the peaks."""
        self.peak_bytes = max(self.peak_bytes, kv_bytes(cache))
        self.peak_deployed = max(self.peak_deployed, deployed_bytes(cache))


@dataclass
class Lane:
    """One cache to decode, and what runs after each of its forwards (eviction)."""

    cache: Cache
    after_forward: Callable[[], None] | None = None


def forward(model: torch.nn.Module, caches: list[Cache], ids: Tensor, batched: bool) -> Tensor:
    """One forward of `ids` (rows, q) over `caches`, observed (H2O's running mass, the sliding window of queries):
    a lone cache directly, several (or one when `batched`) as one batch of BatchedLayers. Returns each row's last
    position's float32 logits (rows, vocab)."""
    if batched:
        cache = Cache(layers=[BatchedLayer(caches, i) for i in range(len(caches[0].layers))])
        watch = observe(None, cache)
    else:
        (cache,) = caches
        watch = observe(StepRecorder(), cache)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **watch)
    return out.logits[:, -1].float()


@torch.inference_mode()
def decode_lanes(
    model: torch.nn.Module,
    lanes: list[Lane],
    ids: Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    forced: bool = False,
    batched: bool = False,
) -> list[Decoded]:
    """The one decode loop. Greedy: feed `ids` (1, q), the question, to every lane's cache, then the token each
    chose, until its stop token or `max_new_tokens`. `forced`: feed `ids` (1, M) one token a step whatever the model
    would have said (logits[j] predicts ids[j + 1]). Every lane's `after_forward` runs after each of its forwards
    (eviction), what its cache held before counting towards its peaks. `batched`: the lanes share each forward."""
    results = [Decoded() for _ in lanes]
    active = list(range(len(lanes)))
    steps = ids.shape[1] - 1 if forced else max_new_tokens
    step_ids = ids[:, :1] if forced else ids
    for n in range(steps):
        rows = step_ids.expand(len(active), -1) if step_ids.shape[0] == 1 else step_ids
        logits = forward(model, [lanes[r].cache for r in active], rows, batched)
        still = []
        for j, r in enumerate(active):
            res, lane = results[r], lanes[r]
            res.saw(lane.cache)  # before eviction: what the step really held
            if lane.after_forward is not None:
                lane.after_forward()
            res.logits.append(logits[j])
            if forced:
                still.append(r)
                continue
            res.tokens.append(int(logits[j].argmax()))
            if res.tokens[-1] not in stop_ids:
                still.append(r)
        if not still:
            break
        active = still
        if forced:
            step_ids = ids[:, n + 1 : n + 2]
        else:
            step_ids = torch.tensor([results[r].tokens[-1] for r in active], device=ids.device)[:, None]
    return results


def greedy(
    model: torch.nn.Module,
    cache: Cache,
    ids: Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    after_forward: Callable[[], None] | None = None,
) -> Decoded:
    """Feed `ids` (the question) then decode greedily; `after_forward` runs after every forward (eviction)."""
    return decode_lanes(model, [Lane(cache, after_forward)], ids, max_new_tokens, stop_ids)[0]


def teacher_forced(
    model: torch.nn.Module, cache: Cache, tokens: Tensor, after_forward: Callable[[], None] | None = None
) -> Decoded:
    """Feed `tokens` (1, M) one at a time, whatever the model would have said; logits[j] predicts tokens[j + 1].

    One token a step, so policies that evict while decoding do so exactly as they would while generating.
    """
    return decode_lanes(model, [Lane(cache, after_forward)], tokens, 0, set(), forced=True)[0]


class BatchedLayer(DynamicLayer):
    """Layer `idx` of several caches seen as one batch: each row's new keys and values go to its own layer, and the
    attention is computed row by row over that layer (through `evalkit_sdpa`, observed as in `greedy`)."""

    is_compileable = False

    def __init__(self, caches: list[Cache], idx: int):
        super().__init__()
        self.caches, self.idx = caches, idx
        self.rows: list[tuple[Tensor, Tensor]] = []
        first = caches[0].layers[idx]
        self.is_sliding = getattr(first, "is_sliding", False)
        self.device, self.is_initialized = first.keys.device, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        require_named(kwargs, self)
        self.rows = [
            cache.layers[self.idx].update(key_states[r : r + 1], value_states[r : r + 1], *args, **kwargs)
            for r, cache in enumerate(self.caches)
        ]
        return key_states, value_states  # each row attends over its own layer: `attend`

    def attends(self, query: Tensor) -> bool:
        return True

    def get_seq_length(self) -> int:
        return self.caches[0].layers[self.idx].get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # every row builds its own mask in `attend`; none is built for the batch

    def attend(self, module, query: Tensor, attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
        """Each row's attention over its own layer: the new queries are the last of its keys, causal among
        themselves (a ragged or quantized row adds its own handling in evalkit_sdpa)."""
        q = query.shape[2]
        out = []
        for r, (cache, (keys, values)) in enumerate(zip(self.caches, self.rows, strict=True)):
            mask = causal_tail_mask(q, keys.shape[-2], query.device) if q > 1 else None
            watch = observe(StepRecorder(), cache)
            out.append(evalkit_sdpa(module, query[r : r + 1], keys, values, mask, **kwargs, **watch)[0])
        self.rows = []
        return torch.cat(out, dim=0), None


def batchable(cache: Cache) -> bool:
    """Whether a cache can decode in a batch: no sliding-window layer (its mask over a question of several tokens
    depends on the window, which the per-row causal mask does not apply), and its next token at the position the
    batch's others take (a re-rotating policy restarts the positions at the count held); those decode alone."""
    return not any(
        getattr(layer, "is_sliding", False) or getattr(layer, "next_position", None) is not None
        for layer in cache.layers
    )
