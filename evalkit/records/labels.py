"""A variant's label, derived from what ran: the policy's class (its import path, recorded in every row) and its
resolved settings, the storage and the prefill; never from a name the user typed.

A class of evalkit's own is labelled by its option in conf/policy (`evalkit.policies.snapkv.SnapKV` -> `snapkv`); a
user's class by the name its config gives, unless that name is one of evalkit's options (a user's class cannot pass
for `snapkv`): then by its class name. A display name other than the derived one stands beside it in brackets,
`none[snapkv]@0.25` (a full cache its user named snapkv), never in its place. Quantized storage is labelled by its
format (`int4`, `fp8`). The run writes these labels and the gate derives them again from each row's record
(evalkit.records.evidence): a row whose label is not the one its record derives is refused.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml

FULL_CACHE = "evalkit.policies.none.FullCache"  # the class that keeps every token: it asks for no compression


@functools.cache
def registry() -> dict[str, str]:
    """Class import path -> the conf/policy option that builds it (the file's name: `policy=snapkv`)."""
    out = {}
    for entry in (resources.files("evalkit.conf") / "policy").iterdir():
        if entry.name.endswith(".yaml"):
            target = (yaml.safe_load(entry.read_text()) or {}).get("_target_")
            if isinstance(target, str):
                out[target] = entry.name[: -len(".yaml")]
    return out


def policy_part(record: dict[str, Any]) -> str:
    """The policy's part of a label from its record (`class`, `name`, and a wrapper's inner policy's record):
    `snapkv`, `chunkkv(snapkv)`, `none[snapkv]`."""
    cls = str(record.get("class"))
    own = registry().get(cls)
    display = record.get("name")
    if own is None:  # a user's class: its config's name, unless it would pass for one of evalkit's
        own = str(display) if display and display not in registry().values() else cls.rpartition(".")[2]
    inner = next((v for v in record.values() if isinstance(v, dict) and "class" in v), None)
    derived = f"{own}({policy_part(inner)})" if inner is not None else own
    return derived if display in (None, derived) else f"{derived}[{display}]"


def quant_part(quant: dict[str, Any] | None) -> str:
    """`+int4`, `+fp8` (and a display name beside it in brackets), '' for full precision."""
    if not quant:
        return ""
    derived = "fp8" if quant.get("format") == "e4m3" else f"int{quant.get('bits')}"
    name = quant.get("name")
    return f"+{derived}" if name in (None, derived) else f"+{derived}[{name}]"


def variant_label(policy: dict[str, Any], quant: dict[str, Any] | None, chunk: int | None) -> str:
    """`snapkv@0.25`, `none@1.0+int4`, `h2o@1024:chunk512`: the label every row of the variant carries."""
    return f"{policy_part(policy)}@{policy.get('budget')}{quant_part(quant)}" + (f":chunk{chunk}" if chunk else "")


def row_label(row: Any) -> str | None:
    """The label a row's record derives (its `policy`, `quant` and `prefill`); None for a row that records no policy
    class (the baseline's, another engine's)."""
    policy = row.get("policy")
    if not isinstance(policy, dict) or not isinstance(policy.get("class"), str):
        return None
    quant, prefill = row.get("quant"), row.get("prefill")
    chunk = prefill.get("chunk") if isinstance(prefill, dict) and prefill.get("mode") == "chunked" else None
    return variant_label(policy, quant if isinstance(quant, dict) else None, chunk)


def chain_key(row: Any) -> tuple[str, Any] | None:
    """A search's chain and step of a row, from its record: the label without its budget (`snapkv+int4`,
    `h2o:chunk512`) and the budget (0.25 or 512); None for a row that records no policy class."""
    if row_label(row) is None:
        return None
    policy, quant, prefill = row["policy"], row.get("quant"), row.get("prefill")
    chunk = prefill.get("chunk") if isinstance(prefill, dict) and prefill.get("mode") == "chunked" else None
    tail = quant_part(quant if isinstance(quant, dict) else None) + (f":chunk{chunk}" if chunk else "")
    return policy_part(policy) + tail, policy.get("budget")


def compression_asked(row: Any) -> bool:
    """Whether a row's variant asked for a smaller cache, from what ran rather than what the row says of it: quantized
    storage, or a policy other than the full cache whose budget is below the whole context (a fraction under 1, or a
    number of tokens, budget_clipped or not). A policy that evicts by a threshold at a budget of 1.0 says so in its
    record (`compression_asked`, KVPolicy.compresses), which can only add to this, never take it away."""
    if row.get("quant"):
        return True
    policy = row.get("policy") if isinstance(row.get("policy"), dict) else {}
    budget = policy.get("budget")
    if policy.get("class") == FULL_CACHE or (policy.get("class") is None and policy.get("name") in (None, "baseline")):
        return False
    below = not (isinstance(budget, float) and budget >= 1.0)
    return below or row.get("compression_asked") is True
