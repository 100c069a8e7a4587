"""What a policy's settings must be before any model loads: the fields every policy has (budget, decode,
decode_interval), their types against their annotations, the policy's own ranges (`check_params`), and a budget that
holds the protected tokens the policy states (`min_tokens()`) on the shortest context of the run."""

from __future__ import annotations

from evalkit.contract.checks import counts_every_protected
from evalkit.contract.policy import KVPolicy, asked_tokens
from evalkit.errors import ConfigError
from evalkit.fields import check_fields


def check_policy(policy: KVPolicy, shortest_context: int | None) -> None:
    """Raise ConfigError for a parameter of the wrong type or out of range, or a budget that cannot work on the
    shortest context of the run (None: unknown). A policy whose budget is not a count of tokens (FullCache,
    DuoAttention: `budget_counts_tokens`) is not held to its protected tokens."""
    b = policy.budget
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise ConfigError(f"policy.budget={b!r}: give a fraction in (0, 1] or a whole number of tokens")
    check_fields(policy, "policy")  # every field against its annotation: bools are bools, ints whole numbers
    check_budget(b)
    if policy.decode and not policy.decodable:
        raise ConfigError(f"{policy.name} compresses once, after the prompt: set policy.decode=false")
    if policy.decode_interval < 1:
        raise ConfigError(
            f"policy.decode_interval={policy.decode_interval}: evict every N >= 1 forwards while decoding, e.g. 16"
        )
    policy.check_params()
    if shortest_context is not None and not counts_every_protected(policy):
        check_min_tokens(policy, shortest_context)


def check_budget(b: float | int) -> None:
    """A fraction in (0, 1] or a whole number of tokens >= 1."""
    if isinstance(b, float) and not 0.0 < b <= 1.0:
        raise ConfigError(
            f"policy.budget={b} is outside (0, 1] as a fraction of the context; "
            "give a fraction such as 0.25 or a whole number of tokens such as 512"
        )
    if isinstance(b, int) and b < 1:
        raise ConfigError(f"policy.budget={b} keeps no token; give a fraction such as 0.25 or tokens such as 512")


def check_min_tokens(policy: KVPolicy, shortest_context: int) -> None:
    """The budget keeps the policy's protected tokens plus one (`min_tokens()`) on a context of `shortest_context`."""
    b = policy.budget
    kept = min(shortest_context, asked_tokens(b, shortest_context))
    if kept < min(policy.min_tokens(), shortest_context):
        what = f"{b} tokens" if isinstance(b, int) else f"a fraction {b} of {shortest_context} tokens"
        raise ConfigError(
            f"policy.budget keeps {kept} tokens ({what}), fewer than the {policy.min_tokens()} that "
            f"{policy.name} needs (its protected tokens plus one); raise policy.budget"
        )
