"""The policy interface: a policy scores tokens; the base class turns scores into kept indices once, for every policy.

The engine (`evalkit.kv.cache`), not the policy, owns caches, gathers and positions. What a policy needs observed in
attention it declares as objects (`needs()`, evalkit.attention.observation) and reads back from its LayerView by the
same objects.
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


@dataclass(kw_only=True)
class KVPolicy:
    """Base policy: keep the `target` highest-scoring tokens per KV head, protected tokens first.

    `budget` is a fraction of the tokens seen (0 < f <= 1, held = ceil(f * seen)) or an absolute number of
    tokens (an int). A fraction of 1.0 keeps every token, so any policy at 1.0 reproduces the full cache.
    """

    name: str
    budget: float | int = 1.0
    decode: bool = True  # also enforce the budget while decoding
    decode_interval: int = 1  # with decode=true: evict after every N-th forward (kvpress DecodingPress's interval)

    # What the engine and the config checks read; a new policy declares them and nothing else changes.
    chunkable: ClassVar[bool] = True  # can evict chunk by chunk in a chunked prefill (prefill=chunked)
    decodable: ClassVar[bool] = True  # can keep its budget while decoding (decode=true)
    ragged: ClassVar[bool] = False  # KV heads of a layer may keep different counts (select pads with -1)
    wrappable: ClassVar[bool] = True  # a wrapper (chunkkv, adakv) may score with it, choosing by its own rule
    reads_question: ClassVar[bool] = False  # scores by the question inside the context: protocol=query_aware only
    # The policy contract (evalkit.contract) counts a policy's protected tokens beyond its budget only up to its
    # stated `min_tokens() - 1` (sinks, windows). False: the budget is not a count of tokens (FullCache keeps them
    # all, DuoAttention's budget is a share of heads) and every protected token counts; evalkit's own policies only.
    budget_counts_tokens: ClassVar[bool] = True
    # Chooses for all evicting layers at once (KVzip's global ranking) in `select_layers`; False: evalkit asks each
    # layer in turn (`over`, then `select`) and holds each to its own budget.
    ranks_across_layers: ClassVar[bool] = False
    adds_tokens: ClassVar[bool] = (
        False  # adds tokens after a one-shot compression (`added`: RestoreKV's restore tokens)
    )

    def needs(self) -> tuple[Observation, ...]:
        """What the engine must record in attention for it, beyond the held keys and values (H2O's mass, SnapKV's
        window queries, KVzip's reconstruction pass); each value is read back by `view.observed(obs)`."""
        return ()

    def observation_window(self) -> int:
        """Context queries the policy scores with (a chunk of a chunked prefill must hold them); 0 when none."""
        return 0

    def prepare(self, model, probes: Probes) -> dict | None:
        """Called once the model is loaded, before any sample: a policy that learns from the model (DuoAttention's
        head roles) does it here, on the prompts `probes` builds, and returns what run.json records under `prepared`;
        None: nothing to prepare."""
        return None

    def score(self, view: LayerView) -> Tensor:
        """(B, Hkv, T) keep-priority of each held token; higher is kept first."""
        raise NotImplementedError

    def protected(self, view: LayerView, k: int) -> Tensor | None:
        """(B, Hkv, T) bool mask of tokens the policy promises to keep, whatever the scores, when keeping k."""
        return None

    def min_tokens(self) -> int:
        """Fewest tokens a budget may keep: the protected tokens plus one. It states how many protected tokens may
        count beyond the budget (evalkit.contract), and every sample's budget must hold it (validate)."""
        return 1

    def target(self, seen: int) -> int:
        """Tokens each head holds once `seen` tokens have gone through the layer; never fewer than the policy's
        protected tokens plus one (which matters early in a chunked prefill, when a fraction of few tokens is
        smaller than, say, SnapKV's window)."""
        return self.held(self.asked(seen), seen)

    def held(self, asked: int, seen: int) -> int:
        """Tokens a head holds when `asked` of `seen` are asked for: never fewer than the protected tokens plus one,
        never more than seen."""
        return min(seen, max(asked, self.min_tokens()))

    def compresses(self) -> bool:
        """Whether the policy asks for a smaller cache than the full one (recorded in every row as
        `compression_asked`; the gate then holds its bytes to gate.min_compression): a budget below the whole
        context, a fraction under 1 or a number of tokens. A policy that evicts by something else than its budget (a
        threshold, lazy layers, pruned channels) says True whatever its budget."""
        return not (isinstance(self.budget, float) and self.budget >= 1.0)

    def asked(self, seen: int) -> int:
        """Tokens the budget itself names for `seen` tokens: ceil(f * seen), or the token count."""
        return math.ceil(self.budget * seen) if isinstance(self.budget, float) else self.budget

    def over(self, view: LayerView, k: int) -> bool:
        """Whether the layer holds more than the policy keeps for a target of k tokens per head (then it evicts)."""
        return view.keys.shape[2] > k

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        """Tokens held per layer; uniform here, layer-dependent policies override it."""
        return [self.target(seen)] * n_layers

    def select_layers(self, views: dict[int, LayerView], targets: dict[int, int]) -> dict[int, Tensor]:
        """For a policy that ranks across layers (`ranks_across_layers`): per evicting layer (index -> its view), the
        indices it keeps (as `select` returns them), together within the sum of the layers' targets."""
        raise NotImplementedError(f"{self.name} ranks layer by layer: evalkit calls over() and select() per layer")

    def select(self, view: LayerView, k: int) -> Tensor:
        """(B, Hkv, k) ascending indices of the tokens each KV head keeps."""
        scores = checked_scores(self, self.score(view), view)
        protected = kept_protected(self, view, k)
        if protected is not None:
            scores = scores.masked_fill(protected, math.inf)
        return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor] | None:
        """The keys and values the kept tokens hold from now on, each (B, Hkv, k, D) as `gather_tokens(view.keys,
        kept)` is, rewritten from what the layer held before the eviction (`view`) and the indices `select` kept: a
        policy that merges evicted values into kept ones, re-rotates kept keys or zeroes key channels says so here.
        None (the default): the kept tokens hold what they held. The engine checks the shape, dtype and finiteness
        (evalkit.contract.check_rewrite); what a layer holds in bytes is measured from the tensors it holds."""
        return None

    def added(self, view: LayerView) -> tuple[Tensor, Tensor] | None:
        """Tokens the policy adds to the layer once the prompt is compressed (one-shot), after the context: keys
        (already rotated at the positions seen .. seen + n - 1) and values, each (B, Hkv, n, D), the same n in every
        layer (RestoreKV's restore tokens). They count against the budget, and the question follows them. The engine
        checks them (evalkit.contract.check_added). Asked only of a policy that declares `adds_tokens`; None: nothing
        is added."""
        return None

    def continues_from_held(self) -> bool:
        """Whether the tokens after the compressed prompt take their RoPE positions from the count held (the largest
        layer's) rather than from the tokens seen: for a policy whose `rewrite` re-rotates the kept keys to slots
        0 .. k-1 (key_rerotation, finch), so that the question follows them as kvpress's pipeline continues after
        those presses. False: every new token takes its true position."""
        return False

    def check_params(self) -> None:
        """Raise ConfigError for a parameter out of its range; the types are checked already (check_fields).
        Policies with parameters extend it."""

    def validate(self, shortest_context: int | None) -> None:
        """Raise ConfigError for a parameter of the wrong type or out of range, or a budget that cannot work on the
        shortest context of the run (None: unknown)."""
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ParamError({"budget": b}, ": give a fraction in (0, 1] or a whole number of tokens")
        check_fields(self)  # every field against its annotation: bools are bools, ints whole numbers
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise ParamError(
                {"budget": b},
                " is outside (0, 1] as a fraction of the context; "
                "give a fraction such as 0.25 or a whole number of tokens such as 512",
            )
        if isinstance(b, int) and b < 1:
            raise ParamError({"budget": b}, " keeps no token; give a fraction such as 0.25 or tokens such as 512")
        if self.decode and not self.decodable:
            raise ParamError({"decode": True}, f": {self.name} compresses once, after the prompt: set $decode=false")
        if self.decode_interval < 1:
            raise ParamError(
                {"decode_interval": self.decode_interval}, ": evict every N >= 1 forwards while decoding, e.g. 16"
            )
        self.check_params()
        if shortest_context is None:
            return
        kept = min(shortest_context, self.asked(shortest_context))
        if kept < min(self.min_tokens(), shortest_context):
            what = f"{b} tokens" if isinstance(b, int) else f"a fraction {b} of {shortest_context} tokens"
            raise ParamError(
                {"budget": b},
                f" keeps {kept} tokens ({what}), fewer than the {self.min_tokens()} that "
                f"{self.name} needs (its protected tokens plus one); raise $budget",
            )


# What KVPolicy builds from its other members: a wrapper that changes one of those has its own, by the base rule over
# its members (evalkit.contract.wrapper), not its inner policy's. A wrapper that chooses by its own rule (select,
# over) ranks layer by layer, whatever its inner policy would.
DERIVED: dict[str, frozenset[str]] = {
    "select": frozenset({"score", "protected"}),
    "over": frozenset({"select"}),
    "select_layers": frozenset({"select", "over"}),
    "ranks_across_layers": frozenset({"select", "over", "select_layers"}),
    "held": frozenset({"min_tokens"}),
    "target": frozenset({"held", "asked", "min_tokens"}),
    "keep_per_layer": frozenset({"target", "held", "asked", "min_tokens"}),
}


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
