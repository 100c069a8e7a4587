"""A budget search judged with one error rate: how far each policy can compress on these samples.

A search run (`search.budgets=[...]`, evalkit.cli.config) holds each policy at several budgets on the same samples.
Its variants form chains, one per policy (the label less its budget, derived from each row's record:
evalkit.records.labels.chain_key), ordered from the largest budget down. Within a chain the budgets are tested in
that order, each at the chain's whole level, and the search stops at the first budget not shown safe; across chains
the level is shared by the graphical procedure (evalkit.stats.chains). A budget shown to fail on other grounds (a
check shown broken, a cell, its records) is never shown safe. The statement per policy: "snapkv: safe down to 0.35
(0.25 not shown: ...; 0.15 FAIL)"; the search PASSes when every policy is safe at some budget, FAILs when a policy is
shown to fail at its largest, and is INCONCLUSIVE otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evalkit.gate.checks import Evidence
from evalkit.gate.decide import Decision, Family
from evalkit.records import BASELINE, Row
from evalkit.records.labels import chain_key
from evalkit.records.merged import Label
from evalkit.stats.chains import PROCEDURE, test_chains

NOT_TESTED = "NOT TESTED"


def is_search(infos: list[dict]) -> tuple[bool, list[str]]:
    """Whether the runs judged are a budget search (their run.json config has search.budgets), and why they cannot be
    judged together (a search judged with runs that are not one)."""
    flags = [bool(_mapping(_mapping(_mapping(i).get("config")).get("search")).get("budgets")) for i in infos]
    if any(flags) and not all(flags):
        return False, [
            "a budget search is judged on its own: judge its run folder alone (the other runs are not "
            "part of its search)"
        ]
    return bool(flags) and all(flags), []


def _mapping(x: Any) -> dict:
    """x where it is a mapping, else an empty one (a run.json of any shape is read without a crash; its checks say
    what is wrong with it)."""
    return x if isinstance(x, dict) else {}


@dataclass
class Chains:
    """A search's chains: chain name -> its variants from the largest budget down, and each variant's budget."""

    steps: dict[str, list[str]]
    budgets: dict[str, Any]


def chains_of(policies: dict[str, list[Row]]) -> tuple[Chains, list[str]]:
    """The chains of a search's variants, from the rows' records; and why they cannot be ordered (a chain holding
    budgets as fractions and as token counts, a variant with no policy record)."""
    chains: dict[str, list[tuple[Any, str]]] = {}
    problems = []
    for name, rows in policies.items():
        key = chain_key(rows[0]) if rows else None
        if key is None:
            problems.append(f"{name}: its rows record no policy class, so no search can order it")
            continue
        prefix = name.prefix if isinstance(name, Label) else ""
        chains.setdefault(f"{prefix}/{key[0]}" if prefix else key[0], []).append((key[1], name))
    out = Chains({}, {})
    for chain, steps in chains.items():
        kinds = {isinstance(b, float) for b, _ in steps}
        if len(kinds) > 1 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b, _ in steps):
            problems.append(
                f"{chain}: its budgets {sorted(str(b) for b, _ in steps)} mix fractions and token counts, which no "
                "order ranks; search one kind of budget"
            )
            continue
        out.steps[chain] = [n for _, n in sorted(steps, key=lambda s: s[0], reverse=True)]
        out.budgets.update({n: b for b, n in steps})
    return out, problems


def chain_family(ev: dict[str, Evidence], skip: set[str], t, chains: Chains) -> Family:
    """The search's PASS claims (evalkit.gate.decide.Family): each chain tested in order, the level shared across
    chains (evalkit.stats.chains). A budget in `skip` (shown to fail, or held back by its own checks) stops its
    chain."""
    alpha = 1 - t.confidence
    pvalues = [[float("nan") if n in skip else ev[n].p_pass for n in steps] for steps in chains.steps.values()]
    results = test_chains(pvalues, alpha, t.multiplicity)
    passed, levels, words, untested = {}, {}, {}, {}
    for (chain, steps), res in zip(chains.steps.items(), results, strict=True):
        for i, name in enumerate(steps):
            passed[name], levels[name] = i < res.rejected, res.levels[i]
            words[name] = f"; the search's fixed sequence over {chain}'s budgets, at level {res.levels[i]:.4g}"
            if i > res.rejected:
                untested[name] = (
                    f"{name}: not tested: {steps[res.rejected]}, a larger budget of {chain}, is not shown safe (the "
                    "search tests the budgets from the largest down and stops at the first not shown safe)"
                )
    claims = sum(len(e.checks) for e in ev.values())  # a FAIL is one claim among every variant's checks (decide)
    fails = f"; {t.multiplicity.capitalize()}'s correction over {claims} claims of a check broken" if claims > 1 else ""
    return Family(passed, levels, words, untested, fails if t.multiplicity != "none" else "")


@dataclass
class Found:
    """What a search found: per chain its statement and steps (verdict.json `search`), the reasons of the chains
    that are not safe at any budget, and the next budget of each chain that more samples could settle."""

    doc: dict[str, Any]
    fail: list[str] = field(default_factory=list)
    open: list[str] = field(default_factory=list)
    next: list[str] = field(default_factory=list)


def found(
    chains: Chains,
    decisions: dict[str, Decision],
    own: dict[str, list[str]],
    summary: dict[str, Any],
    cap: dict[str, Any],
    t,
) -> Found:
    """Each chain's safe budget and why the next one is not, from the decisions (`own`: each variant's reasons to
    FAIL: its checks shown broken, its cells, its records)."""
    out = Found({"procedure": PROCEDURE[t.multiplicity], "policies": {}})
    for chain, steps in chains.steps.items():
        rows = [_step(name, chains.budgets[name], decisions[name], own[name], summary[name]) for name in steps]
        for i, r in enumerate(rows):
            if i and rows[i - 1]["status"] != "PASS" and r["status"] != "FAIL":
                r["status"] = NOT_TESTED
        safe = 0
        while safe < len(rows) and rows[safe]["status"] == "PASS":
            safe += 1
        status = "PASS" if safe else rows[0]["status"]
        first = rows[safe] if safe < len(rows) else None
        entry = {
            "status": status,
            "safe_budget": rows[safe - 1]["budget"] if safe else None,
            "safe_variant": steps[safe - 1] if safe else None,
            "first_not_safe": first["variant"] if first else None,
            "steps": rows,
            "statement": statement(chain, rows, safe),
            "capacity": _capacity(steps[safe - 1], cap, t) if safe else None,
        }
        out.doc["policies"][chain] = entry
        if status == "FAIL":
            out.fail += own[steps[0]]
        elif status == "INCONCLUSIVE":
            out.open += decisions[steps[0]].open
        if first is not None and first["status"] == "INCONCLUSIVE":
            out.next.append(first["variant"])
    return out


def _step(name: str, budget: Any, d: Decision, own: list[str], s: dict[str, Any]) -> dict[str, Any]:
    drop = ((s.get("gate") or {}).get("checks") or {}).get("drop") or {}
    status = "FAIL" if own else d.status
    return {
        "variant": str(name),
        "budget": budget,
        "status": status,
        "drop": (s.get("paired") or {}).get("drop"),
        "accuracy": s.get("accuracy"),
        "baseline_accuracy": s.get("baseline_accuracy"),
        "drop_bounds": drop.get("bounds"),
        "kv_ratio": s.get("kv_ratio"),
        "kv_ratio_context": s.get("kv_ratio_context"),
        "n": s.get("n"),
        "why": own if status == "FAIL" else ([] if status == "PASS" else d.open),
    }


def statement(chain: str, rows: list[dict[str, Any]], safe: int) -> str:
    """`snapkv: safe down to 0.35 (0.25 not shown: the drop may be as large as 0.071; 0.15 FAIL)`."""
    head = f"{chain}: safe down to {rows[safe - 1]['budget']}" if safe else f"{chain}: safe at no budget searched"
    rest = []
    for r in rows[safe:]:
        bounds = r.get("drop_bounds") or [None, None]
        if r["status"] == "FAIL":
            low = f": drop at least {bounds[0]:.3f}" if isinstance(bounds[0], (int, float)) else ""
            rest.append(f"{r['budget']} FAIL{low}")
        elif r["status"] == "INCONCLUSIVE":
            high = f": the drop may be as large as {bounds[1]:.3f}" if isinstance(bounds[1], (int, float)) else ""
            rest.append(f"{r['budget']} not shown{high}")
        else:
            rest.append(f"{r['budget']} not tested")
    return head + (f" ({'; '.join(rest)})" if rest else "")


def _capacity(name: str, cap: dict[str, Any], t) -> dict[str, Any] | None:
    """What the safe budget buys: its sequences and bytes per sequence beside the full cache's, at the gate's
    capacity settings."""
    mine, full = cap.get(name), cap.get(BASELINE)
    if not mine or not full:
        return None
    gib, context = t.capacity["gpu_gib"], int(t.capacity["context"])
    times = mine["sequences"] / full["sequences"] if full["sequences"] else None
    said = (
        f"{times:.1f}x the sequences of the full cache"
        if times is not None
        else "sequences where the full cache fits none"
    )
    return {
        "gpu_gib": gib,
        "context": context,
        "sequences": mine["sequences"],
        "sequences_full_cache": full["sequences"],
        "kv_bytes_per_sequence": mine["kv_bytes_per_sequence"],
        "kv_bytes_per_sequence_full_cache": full["kv_bytes_per_sequence"],
        "times": times,
        "text": f"{name} is safe: {said} ({mine['sequences']} against {full['sequences']}) in {gib:g} GiB at "
        f"{context:,} tokens",
    }
