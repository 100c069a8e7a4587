"""Caches that hold a chosen subset of tokens, built on transformers' public cache-layer classes.

Invariant (docs/invariants.md, invariant 2; docs/architecture.md, section 4): a compacted layer reports the tokens
*seen* from `get_seq_length()`, so transformers gives every new token its true absolute (RoPE) position, while
`get_mask_sizes()` reports the tokens *held*, with an offset that keeps the causal mask right for several new tokens
at once. The one exception a policy declares: after it re-rotates its kept keys to slots 0 .. k-1
(`KVPolicy.continues_from_held`), the next token's position restarts at the count held (`next_position`), as kvpress's
pipeline continues after such presses; `positions` still name each held token by its true position.

Ragged layers (head-adaptive policies: AdaKV, DuoAttention) let each KV head hold its own number of tokens. They are
stored padded to the longest head: a padding slot has position -1 and is marked invalid in `valid` (B, Hkv, T),
which `evalkit_sdpa` reads from the layer to mask the padding out of the attention. `kv_bytes` counts what is
allocated here (the padded tensors); `deployed_bytes` and `fp16_bytes` count the tokens really held, what a paged
engine stores.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from evalkit import contract
from evalkit.attention.observation import Observation
from evalkit.attention.sdpa import require_named
from evalkit.contract import KVPolicy, LayerView, gather_tokens


class EvictingLayer(DynamicLayer):
    """A full-attention layer that holds, per KV head, a subset of the tokens it has seen."""

    is_croppable = False

    def __init__(
        self,
        keys: Tensor,
        values: Tensor,
        seen: int,
        state: dict[Observation, Tensor] | None = None,
        observations: dict[Observation, object] | None = None,
    ):
        super().__init__()
        b, h, t, _ = keys.shape
        self.keys, self.values = keys, values  # (B, Hkv, T_held, D)
        self.positions = torch.arange(seen - t, seen, device=keys.device).expand(b, h, t)  # (B, Hkv, T_held)
        self.state = dict(state or {})  # per-token observations (B, Hkv, T_held), gathered along with the keys
        self.observations = observations or {}  # per-layer observations, from the prefill
        self.seen = seen
        # where the next token's RoPE position is counted from, when a policy re-rotated the kept keys to slots
        # 0 .. k-1 (KVPolicy.continues_from_held): the count held then, plus the tokens since; None: the tokens seen
        self.next_position: int | None = None
        self.valid: Tensor | None = None  # (B, Hkv, T_held) False on padding slots; None: every slot is a token
        self.allowed: Tensor | None = None  # (B, Hkv) tokens the policy contract allowed at the last eviction
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if self.valid is not None:
            require_named(kwargs, self)  # evalkit_sdpa masks out the padding `valid` marks
        self.advance(key_states.shape[2])
        return super().update(key_states, value_states)

    def advance(self, q: int) -> None:
        """Account for q new tokens: their absolute positions, zero per-token state, the tokens seen."""
        b, h = self.positions.shape[:2]
        new = torch.arange(self.seen, self.seen + q, device=self.positions.device).expand(b, h, q)
        self.positions = torch.cat([self.positions, new], dim=-1)
        self.state = {k: torch.cat([v, v.new_zeros(b, h, q)], dim=-1) for k, v in self.state.items()}
        if self.valid is not None:
            self.valid = torch.cat([self.valid, self.valid.new_ones(b, h, q)], dim=-1)
        self.seen += q
        if self.next_position is not None:
            self.next_position += q

    def get_seq_length(self) -> int:
        """The position the next token takes: the tokens seen, or after a re-rotation the count it restarted from."""
        return self.seen if self.next_position is None else self.next_position

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.held
        # Held keys get mask indices p-held .. p-1 (p: the next token's position): all before the new queries, which
        # stay causal among themselves. With offset 0 a multi-token query would see its own future.
        return held + query_length, self.get_seq_length() - held

    def append(self, keys: Tensor, values: Tensor) -> None:
        """Hold n tokens more, (B, Hkv, n, D) each, at the next positions (a policy's added tokens)."""
        self.advance(keys.shape[2])
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)

    @property
    def held(self) -> int:
        """Slots per KV head: the tokens each head holds, or for a ragged layer the longest head's."""
        return self.keys.shape[-2]

    def tokens(self) -> Tensor:
        """(B, Hkv) tokens each KV head really holds (padding not counted)."""
        if self.valid is None:
            return torch.full(self.keys.shape[:2], self.held, device=self.keys.device)
        return self.valid.sum(-1)

    def keep(self, idx: Tensor) -> None:
        """Keep only the tokens at per-head indices idx (B, Hkv, k); an index of -1 is a padding slot (ragged
        policies: heads keep different counts)."""
        pad = idx < 0
        ragged = bool(pad.any()) or self.valid is not None
        idx = idx.clamp(min=0)
        self.keys = gather_tokens(self.keys, idx)
        self.values = gather_tokens(self.values, idx)
        self.positions = gather_tokens(self.positions, idx)
        self.state = {k: gather_tokens(v, idx) for k, v in self.state.items()}
        if ragged:
            valid = ~pad if self.valid is None else gather_tokens(self.valid, idx) & ~pad
            self.positions = self.positions.masked_fill(~valid, -1)
            self.state = {k: v.masked_fill(~valid, 0) for k, v in self.state.items()}
            self.valid = None if bool(valid.all()) else valid

    def view(self, layer_idx: int, n_layers: int) -> LayerView:
        return LayerView(
            layer_idx,
            n_layers,
            self.seen,
            self.keys,
            self.values,
            self.positions,
            self.state,
            self.observations,
            self.valid,
        )


def share(cache: Cache) -> Cache:
    """A cache over the same tensors. Layers grow by concatenation, so the original is never modified."""
    return Cache(layers=[copy.copy(layer) for layer in cache.layers])


def full_attention_layers(cache: Cache) -> list[int]:
    """Indices of the layers a policy may evict from; sliding-window layers bound themselves."""
    return [i for i, layer in enumerate(cache.layers) if not getattr(layer, "is_sliding", False)]


def compress(cache: Cache, policy: KVPolicy, observations: dict[int, dict[Observation, object]] | None = None) -> Cache:
    """A new cache holding what `policy` keeps of the prefilled full `cache`; `cache` itself is unchanged.

    `observations` maps a layer index to what the prefill (and any second pass) recorded there for the variants
    (evalkit.attention.observation); the new layers hold those the policy needs, per token or per layer.
    """
    layers = [copy.copy(layer) for layer in cache.layers]
    needs = set(policy.needs())
    for layer_idx in full_attention_layers(cache):
        full, obs = cache.layers[layer_idx], (observations or {}).get(layer_idx, {})
        state = {o: v for o, v in obs.items() if o in needs and o.per_token}
        rest = {o: v for o, v in obs.items() if o in needs and not o.per_token}
        layers[layer_idx] = EvictingLayer(full.keys, full.values, full.get_seq_length(), state, rest)
    compressed = Cache(layers=layers)
    enforce(compressed, policy)
    return compressed


def enforce(cache: Cache, policy: KVPolicy) -> None:
    """Evict until every evictable layer holds the policy's target for the tokens seen, checking the policy's
    contract as it goes (evalkit.contract): indices unique and in range, the tokens held within the budget plus the
    tokens the policy declares protected. Each layer records what it was allowed (`allowed`, (B, Hkv))."""
    evictable = [i for i, layer in enumerate(cache.layers) if isinstance(layer, EvictingLayer)]
    n_layers = len(cache.layers)
    seen = cache.layers[evictable[0]].seen
    # Layer-dependent budgets (PyramidKV) are spread over the layers that evict: on hybrid models the sliding-window
    # layers keep their own bound and take no share.
    with contract.calling(policy, "keep_per_layer"):
        budgets = policy.keep_per_layer(seen, len(evictable))
    targets = dict(zip(evictable, contract.check_budgets(policy, budgets, len(evictable)), strict=True))
    views = {i: cache.layers[i].view(i, n_layers) for i in evictable}
    for i, view in views.items():
        cache.layers[i].allowed = contract.allowance(policy, view, targets[i], i)
    with contract.calling(policy, "ranks_across_layers"):
        across = bool(policy.ranks_across_layers)
    for layer_idx, idx in select(policy, views, targets, across).items():
        layer = cache.layers[layer_idx]
        idx = contract.check_indices(policy, idx, views[layer_idx], layer_idx)
        with contract.calling(policy, "rewrite", layer_idx):
            rewritten = policy.rewrite(views[layer_idx], idx)
        layer.keep(idx)
        if rewritten is not None:
            layer.keys, layer.values = contract.check_rewrite(policy, rewritten, layer, layer_idx)
        if not across:  # one held to each layer's budget; one ranking across layers, to the sum
            contract.check_layer(policy, layer.tokens(), layer.allowed, targets[layer_idx], layer_idx)
    contract.check_held(policy, {i: (cache.layers[i].tokens(), cache.layers[i].allowed) for i in evictable}, seen)
    with contract.calling(policy, "continues_from_held"):
        restart = bool(policy.continues_from_held())
    if restart:  # kept keys re-rotated to slots 0 .. k-1: the next token follows them, as kvpress's pipeline has it
        start = max(cache.layers[i].held for i in evictable)  # one position for every layer, none behind its keys
        for i in evictable:
            cache.layers[i].next_position = start


def add_tokens(cache: Cache, policy: KVPolicy) -> None:
    """The tokens `policy` adds once the prompt is compressed (KVPolicy.added, RestoreKV's restore tokens), appended
    to every layer after the context, then held with the rest to the budget (evalkit.contract)."""
    if not policy.adds_tokens:  # declared: only such a policy is asked
        return
    evictable = [i for i, layer in enumerate(cache.layers) if isinstance(layer, EvictingLayer)]
    added = {}
    for i in evictable:
        layer = cache.layers[i]
        with contract.calling(policy, "added", i):
            got = policy.added(layer.view(i, len(cache.layers)))
        if got is not None:
            added[i] = contract.check_added(policy, got, layer, i)
    if not added:
        return
    contract.check_added_layers(policy, added, len(cache.layers))
    seen = cache.layers[evictable[0]].seen
    for i, (keys, values) in added.items():
        cache.layers[i].append(keys, values)
    contract.check_held(policy, {i: (cache.layers[i].tokens(), cache.layers[i].allowed) for i in evictable}, seen)


def select(policy: KVPolicy, views: dict[int, LayerView], targets: dict[int, int], across: bool) -> dict[int, Tensor]:
    """Per evicting layer over its target, the indices the policy keeps: from `select_layers` when it ranks across
    layers (`across`: its `ranks_across_layers`), else layer by layer (`over`, then `select`), each call named with
    its layer if it raises. The one loop over layers: a policy's `select_layers` only ranks across them."""
    if across:
        with contract.calling(policy, "select_layers"):
            return policy.select_layers(views, targets)
    chosen = {}
    for layer_idx, view in views.items():
        with contract.calling(policy, "over", layer_idx):
            over = policy.over(view, targets[layer_idx])
        if over:
            with contract.calling(policy, "select", layer_idx):
                chosen[layer_idx] = policy.select(view, targets[layer_idx])
    return chosen


def kv_bytes(cache: Cache) -> int:
    """Bytes of the tensors held here (keys and values, a ragged layer's padding included; packed codes, scales and
    minima), over all layers."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.numel() * layer.keys.element_size()
            total += layer.values.numel() * layer.values.element_size()
    return total


DEPLOYED_ELEMENT_BYTES = 2  # fp16 or bf16: what a GPU deployment holds dense keys and values in


def deployed_bytes(cache: Cache) -> int:
    """Bytes the cache would hold in a deployment: dense layers in fp16/bf16 whatever dtype this machine computes
    in (float32 on the CPU), ragged layers only their real tokens (a paged engine stores no padding), quantized
    layers as packed (their codes, fp16 scales and residual window)."""
    return sum(layer.nbytes() if hasattr(layer, "nbytes") else fp16_layer_bytes(layer) for layer in cache.layers)


def fp16_layer_bytes(layer) -> int:
    """Bytes a layer's real tokens take as fp16 keys and values (padding of a ragged layer not counted). A key
    channel that is zero in every token a head holds (ThinK's pruned channels) is not stored: a head's keys count
    its other channels, its values every channel."""
    if getattr(layer, "keys", None) is None or not layer.keys.numel():
        return 0
    b, h, t, d = layer.keys.shape
    tokens = layer.tokens() if isinstance(layer, EvictingLayer) else torch.full((b, h), t, device=layer.keys.device)
    channels = _stored_channels(layer.keys)  # (B, Hkv) key channels each head stores
    return DEPLOYED_ELEMENT_BYTES * int((tokens * (channels + d)).sum())


def _stored_channels(keys: Tensor) -> Tensor:
    """(B, Hkv) key channels nonzero in some token of each head. Where the newest token alone has every channel
    nonzero in every head (any token decoded, and every cache that prunes none), that is all of them without reading
    the rest: the decode counts a cache's bytes after every step, and a scan of every key costs most of a step's
    attention at long contexts."""
    newest = keys[:, :, -1, :] != 0  # (B, Hkv, D)
    if bool(newest.all()):
        return newest.sum(-1)
    return (keys != 0).any(dim=2).sum(-1)


def fp16_bytes(cache: Cache) -> int:
    """Bytes the held tokens would take as fp16 keys and values: the reference for quantized storage."""
    return sum(fp16_layer_bytes(layer) for layer in cache.layers)


def held_per_layer(cache: Cache) -> list[int | float]:
    """Tokens each layer holds per KV head: the same for every head of a dense layer; for a ragged layer the mean
    over its heads (2 decimals), the padding not counted."""
    out = []
    for layer in cache.layers:
        if isinstance(layer, EvictingLayer):
            out.append(layer.held if layer.valid is None else round(layer.tokens().float().mean().item(), 2))
        else:
            out.append(layer.keys.shape[-2] if layer.keys is not None else 0)
    return out


def allowed_per_layer(cache: Cache) -> list[int | float]:
    """Tokens each layer was allowed per KV head at its last eviction (evalkit.contract: the budget plus the tokens
    the policy declares protected; the mean over heads, 2 decimals); a layer that does not evict: what it holds."""
    held = held_per_layer(cache)
    out = []
    for layer, n in zip(cache.layers, held, strict=True):
        allowed = getattr(layer, "allowed", None)
        out.append(n if allowed is None else round(allowed.float().mean().item(), 2))
    return out


def allocated_per_layer(cache: Cache) -> list[int]:
    """Slots each layer allocates per KV head here: the tokens held, or a ragged layer's longest head."""
    return [layer.keys.shape[-2] if layer.keys is not None else 0 for layer in cache.layers]


def held_positions(layer) -> Tensor:
    """(B, Hkv, T_held) absolute positions a layer holds; plain layers hold their most recent tokens."""
    if isinstance(layer, EvictingLayer):
        return layer.positions
    b, h, t, _ = layer.keys.shape
    seen = layer.get_seq_length()
    return torch.arange(seen - t, seen, device=layer.keys.device).expand(b, h, t)


def retained_fraction(cache: Cache, positions: list[int]) -> list[float]:
    """Per layer, the fraction of the given absolute positions still held, averaged over KV heads."""
    out = []
    for layer in cache.layers:
        wanted = torch.tensor(positions, device=layer.keys.device)
        # padding slots of a ragged layer are at position -1, never wanted
        hit = torch.isin(held_positions(layer), wanted).sum(-1).float() / max(len(positions), 1)  # (B, Hkv)
        out.append(round(hit.mean().item(), 4))
    return out
