"""The policy contract, checked at run time for every policy (evalkit.contract): a policy that keeps more than its
budget, returns duplicate or out-of-range indices, scores NaN, or raises, stops with a PolicyError (exit 2) naming
the policy, the layer and what it did, never "a bug in evalkit"; every built-in policy passes (the tests of
test_cache_invariants run every one of them through the same check).

The user policies below are defined here, outside evalkit, as a user's would be. The tiny model has 3 layers of
2 KV heads; the context is CTX = 96 tokens, so budget 0.25 asks for ceil(0.25 x 96) = 24 tokens per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import Tensor

from evalkit import contract
from evalkit.attention.observation import AttentionMass
from evalkit.errors import ConfigError, PolicyError
from evalkit.kv.cache import allowed_per_layer, held_per_layer
from evalkit.kv.variant import Variant
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.chunkkv import ChunkKV
from evalkit.policies.h2o import H2O
from evalkit.policies.streaming_llm import StreamingLLM
from tests.conftest import CTX, compressed


@dataclass(kw_only=True)
class KeepsMore(KVPolicy):
    """Says its target is 90% of the tokens, whatever the budget."""

    name: str = "keepsmore"
    decode: bool = False

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()

    def target(self, seen: int) -> int:
        return math.ceil(0.9 * seen)


@dataclass(kw_only=True)
class Recent(KVPolicy):
    """The most recent tokens; `mischief` breaks its select in one way."""

    name: str = "recent"
    decode: bool = False
    mischief: str = ""

    def score(self, view: LayerView) -> Tensor:
        if self.mischief == "nan":
            return torch.full(view.positions.shape, math.nan)
        if self.mischief == "raise":
            raise ZeroDivisionError("division by zero")
        return view.positions.float()

    def select(self, view: LayerView, k: int) -> Tensor:
        idx = super().select(view, k)
        if self.mischief == "one-more":
            extra = torch.zeros_like(idx[..., :1])  # token 0, which a recency policy never keeps
            return torch.cat([extra, idx], dim=-1)
        if self.mischief == "twice":
            return torch.cat([idx[..., :1], idx[..., :-1]], dim=-1)
        if self.mischief == "out-of-range":
            return idx + 1  # the last index is then the number of tokens held
        if self.mischief == "floats":
            return idx.float()
        return idx


def test_a_policy_keeping_more_than_its_budget_is_stopped_naming_it(tiny, ids):
    """keepsmore@0.25 keeps ceil(0.9 x 96) = 87 tokens per head where the budget allows 24 (it declares nothing
    protected): before, the run went on and the gate PASSed it at 0.90x."""
    with pytest.raises(PolicyError) as err:
        compressed(tiny.model, ids, KeepsMore(budget=0.25))
    assert str(err.value).startswith(
        "keepsmore held 87 of 96 tokens per KV head at layer 0, where a budget of 0.25 x 96 = 24 plus the tokens it "
        "declares protected allow 24 (522 held against 144 allowed over 3 layers"
    )


@pytest.mark.parametrize(
    ("mischief", "message"),
    [
        ("one-more", "recent kept 25 tokens in a KV head at layer 0 where it was asked for 24"),
        ("twice", "select() at layer 0 returned index 72 twice in KV head 0"),
        ("out-of-range", "select() at layer 0 returned index 96, outside the 96 tokens held [0, 96)"),
        ("floats", "select() at layer 0 returned a torch.float32 tensor, not integer indices"),
        ("nan", "policy recent: score() at layer 0 is NaN or infinite for 192 of its 192 scores (2 KV heads x 96"),
        ("raise", "raised ZeroDivisionError in select() at layer 0: division by zero; the fault is in the policy"),
    ],
)
def test_a_select_that_breaks_the_contract_is_named(tiny, ids, mischief, message):
    """Before: more than k indices, duplicates or out-of-range indices were accepted or crashed in a gather, and an
    exception in the policy's code was exit 3, "a bug in evalkit". By hand: recency keeps positions 72..95."""
    with pytest.raises(PolicyError, match=None) as err:
        compressed(tiny.model, ids, Recent(budget=0.25, mischief=mischief))
    assert message in str(err.value), str(err.value)


def test_a_wrapped_user_policy_is_the_one_blamed(tiny, ids):
    """chunkkv(recent): the fault raised inside the user's scorer is the user's, named by its class."""
    with pytest.raises(PolicyError, match=rf"policy recent \({Recent.__module__}.Recent\) raised ZeroDivisionError"):
        compressed(tiny.model, ids, ChunkKV(inner=Recent(mischief="raise"), budget=0.25))


def test_an_evalkit_policy_that_raises_is_evalkits_bug(tiny, ids, monkeypatch):
    """A built-in policy raising is a bug in evalkit: it passes through (exit 3), it is not blamed on the user."""

    def broken(self, view):
        raise RuntimeError("a bug")

    monkeypatch.setattr(StreamingLLM, "score", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        compressed(tiny.model, ids, StreamingLLM(budget=0.25))
    assert contract.users(StreamingLLM(budget=0.25)) is None
    assert contract.users(ChunkKV(inner=Recent(), budget=0.25)).name == "recent"


def test_the_allowance_counts_the_protected_tokens(tiny, ids):
    """streaming_llm@0.03: ceil(0.03 x 96) = 3 tokens asked, but its 4 sinks are protected: each head may hold 5,
    and does (4 sinks + 1 recent)."""
    _, cache = compressed(tiny.model, ids, StreamingLLM(budget=0.03))
    assert allowed_per_layer(cache) == [5, 5, 5] and held_per_layer(cache) == [5, 5, 5]


def test_a_pyramid_of_budgets_passes_on_its_total(tiny, ids):
    """PyramidKV holds more than the uniform budget in its lower layers and less above: the contract holds the sum
    (plus a token a layer and head of rounding), not each layer."""
    from tests.conftest import policy

    pol = policy("pyramidkv", 0.5, beta=2.0)
    _, cache = compressed(tiny.model, ids, pol)
    held = held_per_layer(cache)
    assert held[0] > held[-1] and sum(held) <= sum(allowed_per_layer(cache)) + 3
    assert len(set(held)) > 1 and CTX == 96


@dataclass(kw_only=True)
class Lopsided(KVPolicy):
    """Ranks across layers: each layer keeps its most recent tokens, `share[i]` times the layer's target."""

    name: str = "lopsided"
    decode: bool = False
    share: tuple[float, ...] = (1.5, 1.0, 0.5)
    across: bool = True

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()

    @property
    def ranks_across_layers(self) -> bool:
        return self.across

    def select_layers(self, views: dict[int, LayerView], targets: dict[int, int]) -> dict[int, Tensor]:
        return {i: self.select(view, int(targets[i] * self.share[i])) for i, view in views.items()}


def test_a_policy_ranking_across_layers_is_held_to_the_sum(tiny, ids):
    """budget 0.25 of 96 tokens: 24 per head. Shares 1.5, 1, 0.5 keep 36, 24 and 12 (72 = 3 x 24, within the sum,
    although layer 0 holds more than its own 24); shares 2, 1, 1 keep 48 + 24 + 24 = 96 against 72 allowed plus one
    token per layer and head of rounding (6): stopped. Saying it does not rank across layers, the same class is
    asked layer by layer (`select`, 24 each) and its `select_layers` is never called."""
    model = tiny.model
    _, cache = compressed(model, ids, Lopsided(budget=0.25))
    assert held_per_layer(cache) == [36, 24, 12]
    with pytest.raises(PolicyError, match="lopsided held"):
        compressed(model, ids, Lopsided(budget=0.25, share=(2.0, 1.0, 1.0)))
    _, cache = compressed(model, ids, Lopsided(budget=0.25, share=(2.0, 1.0, 1.0), across=False))
    assert held_per_layer(cache) == [24, 24, 24]


@dataclass(kw_only=True)
class Protects(KVPolicy):
    """Declares its 40 most recent tokens protected and keeps 41; `states` is what its min_tokens() says."""

    name: str = "protects"
    decode: bool = False
    states: int = 41

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()

    def protected(self, view: LayerView, k: int) -> Tensor:
        return view.positions >= view.seen - 40

    def target(self, seen: int) -> int:
        return 41

    def min_tokens(self) -> int:
        return self.states


def test_protected_tokens_count_only_as_far_as_min_tokens_states_them(tiny, ids):
    """budget 0.25 of 96 tokens asks 24 per head. Stating min_tokens() = 41 (40 protected + 1), the 41 it holds are
    allowed; stating 1 (no protected token), the same 40 declared protected count for nothing and 41 is over the 24
    asked (41 x 6 heads = 246 held against 24 x 6 = 144 allowed). Before, both passed: whatever a policy declared
    protected counted. Its stated 41 must fit each sample's budget (24 does not: refused before any runs, whatever
    its own validate says), and only evalkit's own policies may count every protected token."""
    _, cache = compressed(tiny.model, ids, Protects(budget=0.25))
    assert held_per_layer(cache) == [41] * 3 and allowed_per_layer(cache) == [41] * 3
    with pytest.raises(PolicyError, match=r"protects held 41 of 96 .* \(246 held against 144 allowed over 3 layers"):
        compressed(tiny.model, ids, Protects(budget=0.25, states=1))
    with pytest.raises(ConfigError, match="^budget=.* keeps 24 tokens, fewer than the 41 that protects states"):
        contract.check_fits(Protects(budget=0.25), CTX)
    contract.check_fits(Protects(budget=0.5), CTX)  # 48 tokens hold 41

    class Unbounded(Protects):
        budget_counts_tokens = False

    with pytest.raises(PolicyError, match="sets budget_counts_tokens = False, which only evalkit's own"):
        contract.check_declared(Unbounded(budget=0.25))


@dataclass(kw_only=True)
class NamesItsNeeds(KVPolicy):
    """A policy that names what it needs observed by a string, as signals were once named, not by an Observation."""

    name: str = "names"

    def needs(self):
        return ("attn_mass",)


def test_needs_that_are_not_observations_are_refused_before_any_model_loads():
    """needs() returns Observation objects (equal settings, one recording); a name is refused, also through a
    wrapper, whose needs are its inner policy's; a policy that needs nothing passes."""
    for pol in (NamesItsNeeds(budget=0.5), ChunkKV(inner=NamesItsNeeds(), budget=0.5)):
        with pytest.raises(PolicyError, match=r"needs\(\) returned 'attn_mass', not a tuple of Observation objects"):
            Variant(pol).validate()
    Variant(StreamingLLM(budget=0.5)).validate()
    assert ChunkKV(inner=H2O(), budget=0.5).needs() == (AttentionMass(),)


@dataclass(kw_only=True)
class Adds(Recent):
    """Recency, then `count` tokens added after the context (as RestoreKV adds its restore tokens); `mischief`
    breaks what it adds in one way."""

    name: str = "adds"
    count: int = 2
    adds_tokens: ClassVar[bool] = True

    def added(self, view: LayerView) -> tuple[Tensor, Tensor] | None:
        b, h, _, d = view.keys.shape
        n = 0 if self.mischief == "some-layers" and view.layer_idx == 1 else self.count
        if n == 0:
            return None
        keys, values = torch.ones(b, h, n, d), torch.ones(b, h, n, d)
        if self.mischief == "shape":
            return keys[..., :-1], values
        if self.mischief == "inf":
            return keys * math.inf, values
        return keys, values


def test_tokens_a_policy_adds_go_after_the_context_and_count_against_its_budget(tiny, ids):
    """Recency keeping 22 of the 24 tokens a head may hold (budget 0.25) and adding 2 holds 24, the 2 at positions 96
    and 97; the next token is at 98. Keeping 24 and adding 2 more is stopped: 26 per head against 24 allowed."""

    @dataclass(kw_only=True)
    class Room(Adds):
        def target(self, seen: int) -> int:
            return super().target(seen) - self.count

    _, cache = compressed(tiny.model, ids, Room(budget=0.25))
    assert cache.get_seq_length() == CTX + 2
    assert held_per_layer(cache) == [24, 24, 24]
    assert cache.layers[0].positions[0, 0].tolist() == list(range(74, 96)) + [96, 97]
    with pytest.raises(PolicyError) as err:
        compressed(tiny.model, ids, Adds(budget=0.25))
    assert str(err.value).startswith("adds held 26 of 96 tokens per KV head at layer 0, where a budget of 0.25 x 96")


@pytest.mark.parametrize(
    ("mischief", "message"),
    [
        ("some-layers", "Adds): added() gave 2 tokens to some layers and other counts to others (layer 1: 0)"),
        ("shape", "Adds): added() at layer 0 returned keys (1, 2, 2, 15) torch.float32 on cpu, not (1, 2, n, 16)"),
        ("inf", "Adds): added() at layer 0 returned keys that are not finite"),
    ],
)
def test_tokens_added_wrongly_are_named(tiny, ids, mischief, message):
    with pytest.raises(PolicyError) as err:
        compressed(tiny.model, ids, Adds(budget=0.25, mischief=mischief))
    assert message in str(err.value), str(err.value)


def test_a_policy_that_adds_tokens_is_refused_a_chunked_prefill():
    """Its tokens go in after a one-shot compression, which a chunked prefill never makes: refused, not skipped;
    wrapped, the same. A policy that does not add tokens is not."""

    @dataclass(kw_only=True)
    class ChunkableAdds(Adds):
        chunkable = True

    with pytest.raises(ConfigError, match="adds adds tokens after the prompt once it is compressed in one pass"):
        Variant(ChunkableAdds(budget=0.25), chunk=32).validate()
    with pytest.raises(ConfigError, match="adds tokens after the prompt"):
        Variant(ChunkKV(inner=ChunkableAdds(), budget=0.25), chunk=32).validate()
    assert ChunkKV(inner=Adds(), budget=0.25).adds_tokens
    assert not ChunkKV(inner=Recent(), budget=0.25).adds_tokens
    Variant(H2O(budget=0.25), chunk=32).validate()


def test_the_contract_reraises_an_interrupt_and_the_caller_says_whose_it_is():
    """The contract reads no SIGINT state: a KeyboardInterrupt from a user's policy leaves `calling` still an
    interrupt, and `guarding` makes it the policy's fault only when its caller (the command line, which owns
    interrupts) says no SIGINT reached the process."""
    policy = Recent()

    def stop():
        with contract.calling(policy, "score", 1):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stop()
    with pytest.raises(KeyboardInterrupt), contract.guarding([policy], lambda: True):
        stop()
    with pytest.raises(PolicyError, match=r"raised KeyboardInterrupt in score\(\) at layer 1: no Ctrl-C was pressed"):
        with contract.guarding([policy], lambda: False):
            stop()
