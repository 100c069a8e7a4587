"""The policy contract, checked at run time for every policy, built-in or the user's.

After every compression (the prompt's, each chunk of a chunked prefill, each eviction while decoding):

- `select` returned an integer tensor (B, Hkv, k) with k at most the tokens held, every index in range and none
  twice in a head (a ragged policy pads with -1, the only index allowed below 0), and kept what it was asked for:
  at most k tokens per head (a ragged policy: k x Hkv over the layer's heads), or the tokens it declares protected
  where those are more;
- `rewrite`, where a policy rewrites what the kept tokens hold (merged values, re-rotated keys), returned keys and
  values of exactly the kept tokens' shape and dtype, every element finite;
- the tokens held, summed over the evicting layers and their KV heads, are at most what the budget allows: per head
  `min(seen, max(ceil(budget x seen) or the token budget, protected + 1))`, where `protected` counts the tokens the
  policy itself declares it keeps whatever the scores (`KVPolicy.protected`: sinks, a recent or observation window),
  at most the `min_tokens() - 1` it states, which every sample's budget must hold (`check_fits`, before any runs):
  a policy that declares most of the context protected holds its budget all the same. Only evalkit's own policies
  whose budget is not a count of tokens (FullCache; DuoAttention, whose retrieval heads keep their whole context)
  have every protected token counted. The sum, not each layer, is held to it, so that layer-dependent
  budgets (PyramidKV) and budgets shared among heads (AdaKV) pass as long as the total holds; one token per layer
  of slack covers the rounding of per-layer budgets. The allowance is computed from the budget by the base class
  (`asked_tokens`), whatever a policy's own `target` or `keep_per_layer` say;
- anything raised inside any method of a policy that is not evalkit's own (or a wrapper over one) is the policy's
  fault (evalkit.contract.faults).

A violation is a PolicyError (exit 2): one line naming the policy, the layer and what it did.
"""

from __future__ import annotations

import torch
from torch import Tensor

from evalkit.attention.observation import Observation
from evalkit.contract.faults import calling, describe, users
from evalkit.contract.policy import KVPolicy, asked_tokens
from evalkit.contract.view import LayerView
from evalkit.errors import ParamError, PolicyError


def check_budgets(policy: KVPolicy, budgets: object, n_layers: int) -> list[int]:
    """keep_per_layer's answer: one whole number >= 0 per evicting layer."""
    ok = isinstance(budgets, (list, tuple)) and len(budgets) == n_layers
    if ok and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in budgets):
        return list(budgets)
    raise PolicyError(
        f"{describe(policy)}: keep_per_layer() returned {str(budgets)[:80]}, not {n_layers} whole numbers of "
        "tokens (one per evicting layer); fix the policy"
    )


def check_indices(policy: KVPolicy, idx: object, view: LayerView, layer_idx: int) -> Tensor:
    """`select`'s answer, or a PolicyError saying what is wrong with it."""
    b, h, t = view.keys.shape[:3]
    where = f"{describe(policy)}: select() at layer {layer_idx}"
    if not isinstance(idx, Tensor) or idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.is_complex():
        kind = f"a {idx.dtype} tensor" if isinstance(idx, Tensor) else type(idx).__name__
        raise PolicyError(f"{where} returned {kind}, not integer indices (B, Hkv, k); fix the policy")
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (b, h) or idx.shape[2] > t:
        raise PolicyError(
            f"{where} returned indices of shape {tuple(idx.shape)}, not ({b}, {h}, k) with k <= the {t} tokens held; "
            "fix the policy"
        )
    low = -1 if policy.ragged else 0
    if idx.numel() and (int(idx.min()) < low or int(idx.max()) >= t):
        bad = int(idx.min()) if int(idx.min()) < low else int(idx.max())
        pad = " (-1 pads a ragged policy's heads)" if policy.ragged else ""
        raise PolicyError(f"{where} returned index {bad}, outside the {t} tokens held [0, {t}){pad}; fix the policy")
    ordered = idx.sort(dim=-1).values
    twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(twice.any()):
        bi, hi, j = (int(x) for x in twice.nonzero()[0])
        raise PolicyError(
            f"{where} returned index {int(ordered[bi, hi, j])} twice in KV head {hi}: a token is kept once; fix the "
            "policy"
        )
    return idx


def check_rewrite(policy: KVPolicy, rewritten: object, layer, layer_idx: int) -> tuple[Tensor, Tensor]:
    """`rewrite`'s answer for a layer that now holds the kept tokens: two tensors of the shape, dtype and device of
    the keys and values it holds, every element finite; else a PolicyError. The tokens held, and so the bytes, are
    the layer's: a rewrite changes what they hold, never how many."""
    return checked_pair(
        f"{describe(policy)}: rewrite() at layer {layer_idx}",
        rewritten,
        layer,
        lambda new, held: new.shape == held.shape,
        lambda held: f"the {tuple(held.shape)} {held.dtype} on {held.device} of the kept tokens",
    )


def check_added(policy: KVPolicy, added: object, layer, layer_idx: int) -> tuple[Tensor, Tensor]:
    """`added`'s answer for a layer: two tensors (B, Hkv, n, D), n >= 1, of the batch, heads, head size, dtype and
    device of the keys and values the layer holds, every element finite; else a PolicyError."""
    where = f"{describe(policy)}: added() at layer {layer_idx}"

    def fits(new: Tensor, held: Tensor) -> bool:  # the held tensor's batch, heads and head size; n >= 1 tokens
        return new.dim() == 4 and new.shape[2] >= 1 and (new.shape[:2], new.shape[3]) == (held.shape[:2], held.shape[3])

    def wanted(held: Tensor) -> str:
        b, h, _, d = held.shape
        return f"({b}, {h}, n, {d}) {held.dtype} on {held.device} with n >= 1"

    checked_pair(where, added, layer, fits, wanted)
    if added[0].shape[2] != added[1].shape[2]:
        raise PolicyError(f"{where} returned {added[0].shape[2]} keys and {added[1].shape[2]} values; fix the policy")
    return added


def checked_pair(where: str, pair: object, layer, fits, wanted) -> tuple[Tensor, Tensor]:
    """A policy's (keys, values) for `layer`: a pair of tensors, each `fits(new, held)` the tensor the layer holds in
    shape, of its dtype and device, every element finite; else a PolicyError from `where` naming what was `wanted`
    (`wanted(held)`, in words)."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise PolicyError(f"{where} returned {type(pair).__name__}, not (keys, values) or None; fix the policy")
    for name, new, held in zip(("keys", "values"), pair, (layer.keys, layer.values), strict=True):
        if not isinstance(new, Tensor) or not fits(new, held) or (new.dtype, new.device) != (held.dtype, held.device):
            got = f"{tuple(new.shape)} {new.dtype} on {new.device}" if isinstance(new, Tensor) else type(new).__name__
            raise PolicyError(f"{where} returned {name} {got}, not {wanted(held)}; fix the policy")
        if not bool(torch.isfinite(new).all()):
            raise PolicyError(f"{where} returned {name} that are not finite; fix the policy")
    return pair


def check_added_layers(policy: KVPolicy, added: dict[int, tuple[Tensor, Tensor]], n_layers: int) -> None:
    """Tokens added after the prompt take the positions after it in every layer, so every layer takes the same number:
    a PolicyError when some evicting layer gets none or another count, or the model has layers that do not evict
    (sliding-window layers, which hold only their window)."""
    counts = {i: added[i][0].shape[2] if i in added else 0 for i in range(n_layers)}
    if len(set(counts.values())) > 1:
        first = counts[next(iter(added))]
        shown = ", ".join(f"layer {i}: {n}" for i, n in list((i, n) for i, n in counts.items() if n != first)[:3])
        raise PolicyError(
            f"{describe(policy)}: added() gave {first} tokens to some layers and other counts to "
            f"others ({shown}); tokens added after the prompt go into every layer, the same number; fix the policy"
        )


def allowance(policy: KVPolicy, view: LayerView, k: int, layer_idx: int) -> Tensor:
    """(B, Hkv) tokens each head may hold: the budget's tokens, or its protected tokens plus one where they are more,
    counting at most the `min_tokens() - 1` it states (its sinks and windows, which every sample's budget was checked
    to hold: check_fits), and at most the tokens seen. Only evalkit's own policies whose budget counts no tokens
    (FullCache, DuoAttention) have every protected token counted."""
    asked = asked_tokens(policy.budget, view.seen)  # the budget's, whatever the policy's own rule says
    with calling(policy, "protected", layer_idx):
        protected = policy.protected(view, k)
    if protected is None:
        declared = torch.zeros(view.keys.shape[:2], dtype=torch.long, device=view.keys.device)
    else:
        declared = (protected & view.real).sum(-1)
    if not counts_every_protected(policy):
        declared = declared.clamp(max=stated(policy) - 1)
    return declared.add(1).clamp(min=asked).clamp(max=view.seen)


def counts_every_protected(policy: KVPolicy) -> bool:
    """Whether every token `policy` declares protected counts beyond its budget: only evalkit's own policies whose
    budget is not a count of tokens (`budget_counts_tokens`)."""
    return users(policy) is None and not policy.budget_counts_tokens


def stated(policy: KVPolicy) -> int:
    """`min_tokens()`, a whole number >= 1, or a PolicyError."""
    with calling(policy, "min_tokens"):
        n = policy.min_tokens()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PolicyError(f"{describe(policy)}: min_tokens() returned {n!r}, not a whole number >= 1; fix the policy")
    return n


def check_declared(policy: KVPolicy) -> None:
    """Before any model loads: only evalkit's own policies may say their budget counts no tokens; a policy (or one a
    wrapper holds) that defines `added` declares `adds_tokens`, without which the engine never asks for its tokens."""
    owner = users(policy)
    if owner is not None and not owner.budget_counts_tokens:
        raise PolicyError(
            f"{describe(owner)} sets budget_counts_tokens = False, which only evalkit's own none and duo_attention "
            "may: a policy holds at most its budget plus the min_tokens() - 1 tokens it protects; remove it"
        )
    held: KVPolicy | None = policy
    while isinstance(held, KVPolicy):
        if type(held).added is not KVPolicy.added and not held.adds_tokens:  # a wrapper's own added: its class's
            raise PolicyError(
                f"{describe(held)} defines added() but does not declare adds_tokens, so the tokens it adds would "
                "never be asked for: set adds_tokens: ClassVar[bool] = True in the class, or remove added()"
            )
        held = getattr(held, "inner", None)


def check_needs(policy: KVPolicy) -> None:
    """Before any model loads: `needs()` returns observations (evalkit.attention.observation.Observation objects)."""
    with calling(policy, "needs"):
        needs = policy.needs()
    wrong = [o for o in needs if not isinstance(o, Observation)] if isinstance(needs, (tuple, list)) else [needs]
    if wrong:
        raise PolicyError(
            f"{describe(policy)}: needs() returned {wrong[0]!r}, not a tuple of Observation objects "
            "(evalkit.attention.observation: AttentionMass(), WindowQueries(w), or one of its own); fix the policy"
        )


def check_fits(policy: KVPolicy, n_context: int) -> None:
    """Whatever the policy's own validate says: the protected tokens it states (`min_tokens() - 1`) fit its budget
    on a context of n_context tokens, so that they never count beyond what the budget allows."""
    if counts_every_protected(policy):
        return
    need = min(stated(policy), n_context)
    kept = min(n_context, asked_tokens(policy.budget, n_context))
    if kept < need:
        raise ParamError(
            {"budget": policy.budget},
            f" keeps {kept} tokens, fewer than the {stated(policy)} that {policy.name} states it needs "
            "(min_tokens(): its protected tokens plus one); raise $budget",
        )


def check_layer(policy: KVPolicy, held: Tensor, allowed: Tensor, k: int, layer_idx: int) -> None:
    """After a layer's eviction: `select` kept what it was asked for, k tokens per KV head (a ragged policy: k x Hkv
    over the layer's heads), or no more than the tokens it declares protected."""
    cap = allowed.clamp(min=k)  # (B, Hkv)
    over = held.sum(-1) > cap.sum(-1) if policy.ragged else (held > cap).any(-1)
    if bool(over.any()):
        most = int(held.max())
        per = f"{k} per KV head, {k * held.shape[-1]} over the layer's heads" if policy.ragged else f"{k}"
        raise PolicyError(
            f"{policy.name} kept {most} tokens in a KV head at layer {layer_idx} where it was asked for {per} (and "
            f"declares at most {int(allowed.max())} protected or allowed); fix its select"
        )


def check_held(policy: KVPolicy, held: dict[int, tuple[Tensor, Tensor]], seen: int) -> None:
    """After one compression: `held` maps each evicting layer to (tokens held, tokens allowed), each (B, Hkv)."""
    if not held:
        return
    total_held = sum(int(h.sum()) for h, _ in held.values())
    total_allowed = sum(int(a.sum()) for _, a in held.values())
    heads = sum(h.numel() for h, _ in held.values())
    if total_held <= total_allowed + heads:  # one token per layer and head: the rounding of per-layer budgets
        return
    layer_idx, (h, a) = max(held.items(), key=lambda kv: float((kv[1][0] - kv[1][1]).sum()))
    budget, asked = policy.budget, asked_tokens(policy.budget, seen)
    what = f"{budget} tokens" if isinstance(budget, int) else f"a budget of {budget} x {seen} = {asked}"
    raise PolicyError(
        f"{policy.name} held {h.float().mean():.0f} of {seen} tokens per KV head at layer {layer_idx}, where "
        f"{what} plus the tokens it declares protected allow {a.float().mean():.0f} "
        f"({total_held} held against {total_allowed} allowed over {len(held)} layers and their heads); a policy "
        f"keeps at most its budget plus {protects(policy)}: fix its select, target or keep_per_layer"
    )


def protects(policy: KVPolicy) -> str:
    """What check_held counts beyond the budget, in words."""
    if counts_every_protected(policy):
        return "its protected tokens"
    return f"the protected tokens it states, min_tokens() - 1 = {stated(policy) - 1} per KV head"
