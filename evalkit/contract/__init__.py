"""The policy contract, below the KV storage (evalkit.kv) and the policies (evalkit.policies), which both import it:
what a policy sees (view), what it is (policy, wrapper), whose fault an exception is (faults) and what evalkit checks
of every policy at run time (checks). It reads no process-wide state: whoever calls it passes what it must know."""

from evalkit.contract.checks import (
    allowance,
    check_added,
    check_added_layers,
    check_budgets,
    check_declared,
    check_fits,
    check_held,
    check_indices,
    check_layer,
    check_needs,
    check_rewrite,
    counts_every_protected,
    stated,
)
from evalkit.contract.faults import PolicyInterrupt, calling, describe, guarding, policy_fault, users
from evalkit.contract.policy import (
    KVPolicy,
    asked_tokens,
    check_policy,
    checked_scores,
    held_tokens,
    kept_protected,
)
from evalkit.contract.view import LayerView, Probe, Probes, gather_tokens
from evalkit.contract.wrapper import OnceWrapper, Wrapper

__all__ = [
    "KVPolicy",
    "LayerView",
    "OnceWrapper",
    "PolicyInterrupt",
    "Probe",
    "Probes",
    "Wrapper",
    "allowance",
    "asked_tokens",
    "calling",
    "check_added",
    "check_added_layers",
    "check_budgets",
    "check_declared",
    "check_fits",
    "check_held",
    "check_indices",
    "check_layer",
    "check_needs",
    "check_policy",
    "check_rewrite",
    "checked_scores",
    "counts_every_protected",
    "describe",
    "gather_tokens",
    "guarding",
    "held_tokens",
    "kept_protected",
    "policy_fault",
    "stated",
    "users",
]
