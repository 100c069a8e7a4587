"""The policy interface: a policy scores tokens; the base class turns scores into kept indices once, for every policy.

The engine (`evalkit.kv.cache`), not the policy, owns caches, gathers and positions. What a policy needs observed in
attention it declares as objects (`needs()`, evalkit.attention.observation) and reads back from its LayerView by the
same objects.

**The budget.** `budget` is a fraction of the tokens seen (0 < f <= 1) or a number of tokens (an int). A fraction of
1.0 keeps every token, so any policy at 1.0 reproduces the full cache. One rule says how many tokens a layer holds:
`keep_per_layer(seen, n_layers)`, the tokens each KV head of every evicting layer holds once `seen` tokens went
through. By default it is uniform, `target(seen)` in every layer, and `target` is the budget's arithmetic
(`held_tokens(asked_tokens(budget, seen), seen, min_tokens())`: ceil(f x seen) or the token count, never fewer than
the protected tokens plus one, which matters early in a chunked prefill, never more than seen). A policy with
per-layer budgets (PyramidKV, PerLayer, LUKV) overrides `keep_per_layer`; one that keeps another count everywhere
overrides `target`. Whatever either says, the policy contract (evalkit.contract) holds the cache to `asked_tokens`
plus the protected tokens the policy states (`min_tokens() - 1`: sinks, windows).

**The choice.** Per layer, `over(view, k)` says whether the layer holds more than its k tokens per head (then it
evicts) and `select(view, k)` which it keeps: the top k of `score`, `protected` tokens first. A policy that ranks
all evicting layers at once (KVzip) declares `ranks_across_layers` and answers `select_layers` instead.

**Capabilities** are class attributes, data the engine and the config checks read; a new policy declares them and
nothing else changes. The parameters' ranges are checked before any model loads (`check_policy`:
the budget, decode, decode_interval, min_tokens against the shortest context; then the policy's `check_params`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.attention.observation import Observation
from evalkit.contract.view import LayerView, Probes
from evalkit.errors import ParamError, PolicyError
from evalkit.fields import check_fields


def asked_tokens(budget: float | int, seen: int) -> int:
    """Tokens a budget names for `seen` tokens: ceil(f x seen) for a fraction f, else the token count itself."""
    return math.ceil(budget * seen) if isinstance(budget, float) else budget


def held_tokens(asked: int, seen: int, min_tokens: int) -> int:
    """Tokens a head holds when `asked` of `seen` are asked for: at least `min_tokens`, at most `seen`."""
    return min(seen, max(asked, min_tokens))


@dataclass(kw_only=True)
class KVPolicy:
    """Keep the highest-scoring tokens per KV head within the budget, protected tokens first (module docstring)."""

    name: str
    budget: float | int = 1.0  # a fraction of the tokens seen, or a number of tokens
    decode: bool = True  # also enforce the budget while decoding
    decode_interval: int = 1  # with decode=true: evict after every N-th forward (kvpress DecodingPress's interval)

    # Capabilities.
    chunkable: ClassVar[bool] = True  # can evict chunk by chunk in a chunked prefill (prefill=chunked)
    decodable: ClassVar[bool] = True  # can keep its budget while decoding (decode=true)
    ragged: ClassVar[bool] = False  # KV heads of a layer may keep different counts (select pads with -1)
    wrappable: ClassVar[bool] = True  # a wrapper (chunkkv, adakv) may score with it, choosing by its own rule
    reads_question: ClassVar[bool] = False  # scores by the question inside the context: protocol=query_aware only
    ranks_across_layers: ClassVar[bool] = False  # chooses for all evicting layers at once (select_layers)
    adds_tokens: ClassVar[bool] = False  # adds tokens after a one-shot compression (added: RestoreKV's)
    # False: the budget is not a count of tokens (FullCache, DuoAttention: evalkit's own only), and the contract
    # counts every protected token beyond it, not only the `min_tokens() - 1` stated.
    budget_counts_tokens: ClassVar[bool] = True

    # What it observes, learns and accepts.
    def needs(self) -> tuple[Observation, ...]:
        """What the engine records in attention for it (H2O's mass, SnapKV's window queries), read back by
        `view.observed(obs)`."""
        return ()

    def observation_window(self) -> int:
        """Context queries it scores with (a chunk of a chunked prefill must hold them); 0 when none."""
        return 0

    def prepare(self, model, probes: Probes) -> dict | None:
        """Once the model is loaded, before any sample (DuoAttention's head roles): what run.json records."""
        return None

    def check_params(self) -> None:
        """A ConfigError for a parameter of its own out of range (the types are checked already)."""

    def validate(self, shortest_context: int | None) -> None:
        """A ConfigError for a setting out of range, its own by `check_params` (check_policy, which evalkit calls)."""
        check_policy(self, shortest_context)

    # The budget: one rule, keep_per_layer; target is its uniform case.
    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        """Tokens each KV head of every evicting layer holds once `seen` tokens went through."""
        return [self.target(seen)] * n_layers

    def target(self, seen: int) -> int:
        """Tokens each KV head holds in every layer: the budget's, clamped to [min_tokens(), seen]."""
        return held_tokens(asked_tokens(self.budget, seen), seen, self.min_tokens())

    def min_tokens(self) -> int:
        """Fewest tokens a budget may keep: the protected tokens plus one (how many count beyond the budget)."""
        return 1

    def compresses(self) -> bool:
        """Whether it asks for a smaller cache than the full one (rows' `compression_asked`): True for a policy that
        evicts by something else than its budget (a threshold, lazy layers, pruned channels)."""
        return not (isinstance(self.budget, float) and self.budget >= 1.0)

    # The choice.
    def score(self, view: LayerView) -> Tensor:
        """(B, Hkv, T) keep-priority of each held token; higher is kept first."""
        raise NotImplementedError

    def protected(self, view: LayerView, k: int) -> Tensor | None:
        """(B, Hkv, T) bool mask of tokens it keeps whatever the scores, when keeping k; None: none."""
        return None

    def over(self, view: LayerView, k: int) -> bool:
        """Whether the layer holds more than its target of k tokens per head (then it evicts)."""
        return view.keys.shape[2] > k

    def select(self, view: LayerView, k: int) -> Tensor:
        """(B, Hkv, k) ascending indices of the tokens each KV head keeps."""
        scores = checked_scores(self, self.score(view), view)
        protected = kept_protected(self, view, k)
        if protected is not None:
            scores = scores.masked_fill(protected, math.inf)
        return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values

    def select_layers(self, views: dict[int, LayerView], targets: dict[int, int]) -> dict[int, Tensor]:
        """With `ranks_across_layers`: per evicting layer, the indices it keeps, within the sum of the targets."""
        raise NotImplementedError(f"{self.name} ranks layer by layer: evalkit calls over() and select() per layer")

    # After the choice.
    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor] | None:
        """The keys and values the kept tokens hold from now on, each (B, Hkv, k, D) (merged values, re-rotated keys,
        zeroed channels), from `view` as it was before the eviction; None: what they held."""
        return None

    def added(self, view: LayerView) -> tuple[Tensor, Tensor] | None:
        """With `adds_tokens`: keys (rotated at seen .. seen + n - 1) and values, each (B, Hkv, n, D), added to every
        layer after the compressed prompt, counted against the budget (RestoreKV's restore tokens)."""
        return None

    def continues_from_held(self) -> bool:
        """Whether the tokens after the compressed prompt take their positions from the count held (a `rewrite` that
        re-rotates kept keys to slots 0 .. k-1: key_rerotation, finch) rather than from the tokens seen."""
        return False


# What KVPolicy builds from its other members: a wrapper that changes one of those has its own, by the base rule over
# its members (evalkit.contract.wrapper), not its inner policy's. A wrapper that chooses by its own rule (select,
# over) ranks layer by layer, whatever its inner policy would.
DERIVED: dict[str, frozenset[str]] = {
    "select": frozenset({"score", "protected"}),
    "over": frozenset({"select"}),
    "select_layers": frozenset({"select", "over"}),
    "ranks_across_layers": frozenset({"select", "over", "select_layers"}),
    "target": frozenset({"min_tokens"}),
    "keep_per_layer": frozenset({"target", "min_tokens"}),
}


def check_policy(policy: KVPolicy, shortest_context: int | None) -> None:
    """Raise ConfigError for a parameter of the wrong type or out of range, or a budget that cannot work on the
    shortest context of the run (None: unknown). A policy whose budget is not a count of tokens (FullCache,
    DuoAttention: `budget_counts_tokens`) is not held to its protected tokens."""
    b = policy.budget
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise ParamError({"budget": b}, ": give a fraction in (0, 1] or a whole number of tokens")
    check_fields(policy)  # every field against its annotation: bools are bools, ints whole numbers
    check_budget(b)
    if policy.decode and not policy.decodable:
        raise ParamError({"decode": True}, f": {policy.name} compresses once, after the prompt: set $decode=false")
    if policy.decode_interval < 1:
        raise ParamError(
            {"decode_interval": policy.decode_interval}, ": evict every N >= 1 forwards while decoding, e.g. 16"
        )
    policy.check_params()
    if shortest_context is not None and policy.budget_counts_tokens:
        check_min_tokens(policy, shortest_context)


def check_budget(b: float | int) -> None:
    """A fraction in (0, 1] or a whole number of tokens >= 1."""
    if isinstance(b, float) and not 0.0 < b <= 1.0:
        raise ParamError(
            {"budget": b},
            " is outside (0, 1] as a fraction of the context; "
            "give a fraction such as 0.25 or a whole number of tokens such as 512",
        )
    if isinstance(b, int) and b < 1:
        raise ParamError({"budget": b}, " keeps no token; give a fraction such as 0.25 or tokens such as 512")


def check_min_tokens(policy: KVPolicy, shortest_context: int) -> None:
    """The budget keeps the policy's protected tokens plus one (`min_tokens()`) on a context of `shortest_context`."""
    b = policy.budget
    kept = min(shortest_context, asked_tokens(b, shortest_context))
    if kept < min(policy.min_tokens(), shortest_context):
        what = f"{b} tokens" if isinstance(b, int) else f"a fraction {b} of {shortest_context} tokens"
        raise ParamError(
            {"budget": b},
            f" keeps {kept} tokens ({what}), fewer than the {policy.min_tokens()} that "
            f"{policy.name} needs (its protected tokens plus one); raise $budget",
        )


def checked_scores(policy: KVPolicy, scores: object, view: LayerView) -> Tensor:
    """`score`'s answer as float32 (B, Hkv, T), or a PolicyError: the wrong shape, or a score that is NaN or infinite
    on a token that holds one (padding slots of a ragged layer are not scored)."""
    shape = tuple(view.keys.shape[:3])
    if not isinstance(scores, Tensor) or tuple(scores.shape) != shape:
        got = f"shape {tuple(scores.shape)}" if isinstance(scores, Tensor) else type(scores).__name__
        raise PolicyError(f"policy {policy.name}: score() returned {got}, not {shape} (B, Hkv, T); fix the policy")
    scores = scores.float()
    bad = ~torch.isfinite(scores) & view.real
    if bool(bad.any()):
        raise PolicyError(
            f"policy {policy.name}: score() at layer {view.layer_idx} is NaN or infinite for {int(bad.sum())} of its "
            f"{int(view.real.sum())} scores ({shape[1]} KV heads x {shape[2]} tokens); scores must be finite numbers: "
            "fix the policy"
        )
    return scores


def kept_protected(policy: KVPolicy, view: LayerView, k: int) -> Tensor | None:
    """(B, Hkv, T) the tokens `policy` protects when keeping k (a wrapper's are its inner policy's), or None; a
    ValueError, named by the policy, when a head protects more than the k it keeps."""
    protected = policy.protected(view, k)
    if protected is not None and int(protected.sum(-1).max()) > k:
        raise ValueError(f"{policy.name}: {int(protected.sum(-1).max())} protected tokens exceed the {k} kept")
    return protected
