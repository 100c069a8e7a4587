"""verdict.json read and written out as text: its fields as the console, report.md, report.html, the planner and W&B
show them. The gate writes verdict.json (evalkit.gate.outputs.verdict_doc; docs/verdict.schema.json describes it);
everything here reads only what it holds, so the report and the planner show a verdict without judging."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.records import write_atomic
from evalkit.units import fmt_bytes

VERDICT = "verdict.json"
SCHEMA = "evalkit.verdict/1"  # verdict.json's version: docs/verdict.schema.json describes it
DESCRIPTIVE = "descriptive"  # a fixed-n interval shown beside the gate's bound: not what the gate decided on
SHOWN_TO_FAIL = "shown to fail"  # the one cell status that is a failure ("no failure shown", "not judged: ..." are not)


def drop_bound(s: dict[str, Any]) -> dict[str, Any] | None:
    """The drop bound the gate decided on for a variant (`s`: its entry in a verdict): {"bounds": [lower, upper],
    "method"} from its drop check, one-sided each at the gate's confidence, counted in contexts. None where the gate
    did not judge the drop (the baseline, CANNOT JUDGE, gate.max_drop null): only a descriptive interval is left."""
    check = ((s.get("gate") or {}).get("checks") or {}).get("drop") if isinstance(s, dict) else None
    bounds = check.get("bounds") if isinstance(check, dict) else None
    if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
        return None
    return {"bounds": list(bounds), "method": str(check.get("method"))}


def signed(x: Any, digits: int = 3) -> str:
    """A bound as the outputs print it (+0.203), or `none` where there is none (null in verdict.json, NaN)."""
    return f"{x:+.{digits}f}" if isinstance(x, (int, float)) and x == x else "none"


def output_folder(out: Path) -> Path:
    """`out`, created if missing; a ConfigError when it is a file or cannot be created."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a folder: give --out a folder (it is created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {out} ({err.strerror or err}); give --out a writable folder") from None
    return out


def write_text(path: Path, text: str) -> None:
    """Write a gate output atomically (records.write_atomic), or a ConfigError naming it."""
    try:
        write_atomic(path, text)
    except OSError as err:
        raise ConfigError(f"could not write {path} ({err.strerror or err}); give --out a writable folder") from None


def search_lines(search: dict[str, Any] | None) -> list[str]:
    """A budget search's answer, a line per policy (its statement and what its safe budget buys), and the procedure
    that shared the error rate (verdict.json's `search`; evalkit.gate.search)."""
    if not search:
        return []
    out = [f"budget search: {search['procedure']}"]
    for entry in search["policies"].values():
        out.append(f"{entry['status']}: {entry['statement']}")
        if entry.get("capacity"):
            out.append(f"  {entry['capacity']['text']}")
    return out


def search_table(search: dict[str, Any] | None) -> list[str]:
    """Markdown: every budget of every policy searched, its status, drop bounds and KV ratio."""
    if not search:
        return []
    lines = [
        "",
        "## How far each policy can compress",
        "",
        *[f"- {line}" for line in search_lines(search)],
        "",
        "| policy | budget | status | n | drop [bounds] | KV ratio (decoded from) | context only | why not |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for chain, entry in search["policies"].items():
        for r in entry["steps"]:
            lo, hi = r.get("drop_bounds") or [None, None]
            why = "; ".join(r["why"][:1]).replace("|", "/")
            lines.append(
                f"| {str(chain).replace('|', '/')} | {r['budget']} | {r['status']} | {r['n']} | {signed(r['drop'])} "
                f"[{signed(lo)}, {signed(hi)}] | {_ratio(r['kv_ratio'])} | {_ratio(r['kv_ratio_context'])} | {why} |"
            )
    return lines


def _ratio(x: Any) -> str:
    """A KV ratio in a table (`-` where none was measured, or it is not finite: null in verdict.json)."""
    return f"{x:.3f}x" if isinstance(x, (int, float)) and x == x else "-"


def headline_text(status: str, declared: list[str], non_default: list[str]) -> str:
    """headline() from a verdict's fields (verdict.json's `verdict`, `declared_bytes`, `non_default_thresholds`: the
    report prints the console's words)."""
    if status != "PASS":
        return status
    text = "PASS"
    if declared:
        text += (
            f" on declared KV bytes ({', '.join(declared)}: the bytes follow from the KV dtype declared "
            "for each server, never observed)"
        )
    if non_default:
        text += f" at thresholds other than the defaults ({len(non_default)} changed, below)"
    return text


def note_lines(partial: list[str], declared: list[str], non_default: list[str]) -> list[str]:
    """notes() from a verdict's fields (verdict.json's `unfinished`, `declared_bytes`, `non_default_thresholds`)."""
    changed = (
        ["thresholds other than the defaults (conf/gate/default.yaml): " + "; ".join(non_default)]
        if non_default
        else []
    )
    return (
        list(partial)
        + [f"{name}: KV bytes declared from the server's KV dtype (backend=openai), not observed" for name in declared]
        + changed
    )


def chunked_table(comparisons: list[dict[str, Any]]) -> list[str]:
    """Markdown: each chunked variant beside its one-shot twin (empty when the runs hold none)."""
    if not comparisons:
        return []
    lines = [
        "",
        "Chunked vs one-shot prefill, paired on the same samples (difference = chunked - one-shot).",
        "",
        "| variant | chunk | n | baseline | one-shot | chunked | difference [95% bounds] | chunked lost/gained | "
        "peak KV one-shot | peak KV chunked | peak tokens chunked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        lo, hi = c["difference_bounds"]
        lines.append(
            f"| {c['variant']} | {c['chunk']} | {c['n']} | {c['baseline']:.2f} | {c['oneshot']:.2f} | "
            f"{c['chunked']:.2f} | {c['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {c['chunked_lost']}/"
            f"{c['chunked_gained']} | {fmt_bytes(c['oneshot_peak_kv_bytes'], 'MiB')} | "
            f"{fmt_bytes(c['chunked_peak_kv_bytes'], 'MiB')} | {c['chunked_peak_tokens']} |"
        )
    return lines


def verdict_fields(doc: dict[str, Any], label: str | None) -> dict[str, Any]:
    """A verdict as one W&B run's summary fields: the overall status, the variant's own status and reasons (every
    reason, for the baseline and for a variant the verdict does not name), and the drop bound the gate decided on
    with its method (the one drop bound: the run's own summary names its fixed-n interval descriptive)."""
    entry = (doc.get("variants") or {}).get(label) or {} if label else {}
    status = entry.get("gate") or {}
    reasons = doc.get("reasons") or []
    own = [r for r in reasons if label and r.startswith(f"{label}: ")]
    bound = drop_bound(entry)
    drop = {} if bound is None else dict(zip(("drop_lower", "drop_upper"), bound["bounds"], strict=True))
    if bound is not None:
        drop["drop_bound_method"] = bound["method"]
    fields = {"verdict": doc.get("verdict"), "gate_status": status.get("status"), "gate_reasons": own or reasons}
    return fields | drop | (search_fields(doc, label) if label else {})


def search_fields(doc: dict[str, Any], label: str) -> dict[str, Any]:
    """In a budget search, the answer for the variant's policy under `search/`: its status and statement, the safe
    budget, the KV ratio of the cache decoded from at it, the sequences it buys beside the full cache's, and this
    budget's status in the search (every variant of a policy carries its policy's answer, so a W&B panel grouped by
    policy reads it from any of them)."""
    search = doc.get("search") if isinstance(doc.get("search"), dict) else {}
    policies = search.get("policies") if isinstance(search.get("policies"), dict) else {}
    for chain, entry in policies.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("steps"), list):
            continue
        steps = {st.get("variant"): st for st in entry["steps"] if isinstance(st, dict)}
        if label not in steps:
            continue
        safe = steps.get(entry.get("safe_variant")) or {}
        capacity = entry.get("capacity") if isinstance(entry.get("capacity"), dict) else {}
        return {
            "search/policy": chain,
            "search/status": entry.get("status"),
            "search/statement": entry.get("statement"),
            "search/safe_budget": entry.get("safe_budget"),
            "search/safe_kv_ratio": safe.get("kv_ratio"),
            "search/sequences": capacity.get("sequences"),
            "search/sequences_full_cache": capacity.get("sequences_full_cache"),
            "search/times_the_sequences": capacity.get("times"),
            "search/step_status": steps[label].get("status"),
            "search/procedure": search.get("procedure"),
        }
    return {}


def label_of(variant: str, labels: list[str]) -> str | None:
    """The verdict's label for a run's own variant name: the name itself, or the one merged label that adds a
    `model/` or `task/` prefix or a ` [folder]` suffix to it (evalkit.records.merged.merge); None when not one."""
    if variant in labels:
        return variant
    found = [x for x in labels if x.split(" [")[0].endswith(f"/{variant}") or x.split(" [")[0] == variant]
    return found[0] if len(found) == 1 else None
