"""What the gate writes and prints: verdict.json (verdict_doc), report.md with its tables, and the console lines."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from evalkit.gate.judge import Verdict
from evalkit.records import to_json
from evalkit.records.merged import label_fields
from evalkit.records.verdict import (
    DESCRIPTIVE,
    SCHEMA,
    VERDICT,
    chunked_table,
    drop_bound,
    headline_text,
    note_lines,
    output_folder,
    search_lines,
    search_table,
    signed,
    write_text,
)
from evalkit.thresholds import Thresholds
from evalkit.units import fmt_bytes

REPORT = "report.md"


def verdict_doc(verdict: Verdict, t: Thresholds) -> dict[str, Any]:
    """verdict.json: what the gate decided, why, at which thresholds and look, and the command that extends an
    INCONCLUSIVE run (the report shows the same document); docs/verdict.schema.json is its JSON Schema."""
    return {
        "schema": SCHEMA,
        "verdict": verdict.status,
        "reasons": verdict.reasons,
        "not_judged": verdict.not_judged,
        "advice": verdict.advice,
        "extend": verdict.extend,
        "cells": verdict.cells,
        "thresholds": asdict(t),
        "runs": verdict.runs,
        "variants": {name: {**s, **label_fields(name)} for name, s in verdict.variants.items()},
        "chunked_vs_oneshot": verdict.chunked,
        "look": verdict.look,
        "digest": verdict.digest,
        "unfinished": verdict.partial,
        "declared_bytes": verdict.declared,
        "non_default_thresholds": verdict.non_default,
        "search": verdict.search,
    }


def headline(verdict: Verdict) -> str:
    """The verdict's first line: the status, and for a PASS on KV bytes no engine observed, or at thresholds other
    than the defaults, that it is one."""
    return headline_text(verdict.status, verdict.declared, verdict.non_default)


def notes(verdict: Verdict) -> list[str]:
    """What the verdict stands on that a reader must know: unfinished runs, bytes declared rather than observed,
    thresholds other than the defaults."""
    return note_lines(verdict.partial, verdict.declared, verdict.non_default)


def write_outputs(verdict: Verdict, out_dir: Path, t: Thresholds) -> None:
    output_folder(out_dir)
    write_text(out_dir / VERDICT, to_json(verdict_doc(verdict, t), indent=2) + "\n")
    lines = [f"# evalkit gate: {headline(verdict)}", ""]
    if verdict.status == "CANNOT JUDGE":
        lines += ["These records cannot be judged (exit code 2); the tables below, if any, are not a verdict.", ""]
    if verdict.status == "INCONCLUSIVE":
        lines += [
            "Neither shown within the thresholds nor shown outside them at the gate's confidence (exit code 2): "
            + (verdict.advice or "more samples would settle it")
            + ".",
            "",
            *([f"To extend the run: `{verdict.extend}`", ""] if verdict.extend else []),
        ]
    lines += [f"- note: {n}" for n in notes(verdict)]
    lines += (
        [f"- {r}" for r in verdict.reasons]
        or [f"- {x}" for x in search_lines(verdict.search)]
        or [
            f"Every threshold is shown to hold at {t.confidence:.0%} one-sided confidence ({t.multiplicity} across "
            f"variants), at look {verdict.look.get('look', 1)} of this run (the confidence holds over all its looks)."
        ]
    )
    if verdict.not_judged:
        lines += [
            "",
            "Not judged: cells where the full-cache baseline is below min_baseline_accuracy, a cell criterion that "
            "could judge no cell, a look that could not be recorded.",
            "",
        ]
        lines += [f"- not judged: {c}" for c in verdict.not_judged]
    lines += search_table(verdict.search)
    if verdict.variants:
        lines += tables(verdict, t)
    if verdict.cells:
        lines += cell_table(verdict.cells, t)
    lines += ["", "Thresholds: " + ", ".join(f"{k}={v}" for k, v in asdict(t).items()), ""]
    write_text(out_dir / REPORT, "\n".join(lines))


def tables(verdict: Verdict, t: Thresholds) -> list[str]:
    lines = [
        "",
        f"Drop bounds: the gate's, one-sided {t.confidence:.0%} each, counted in contexts, by the anytime-valid betting"
        f" test that judges every look; status after {t.multiplicity} across variants, with the look that reached it."
        f" A bound whose method says {DESCRIPTIVE} is a fixed-n interval the gate did not decide on.",
        "",
        "KV ratio: the KV bytes of the cache each answer was decoded from, at its largest (the compressed context, the "
        "question and the answer), over the full cache's on the same request, both as a deployment holds them (dense "
        "in fp16/bf16, quantized packed): the figure gate.min_compression judges; context only: the compressed "
        "context right after compression over the full context's (not judged); KV measured: bytes held here, in the "
        "model's own dtype.",
        "",
        "| variant | status | n | baseline | policy | drop [bounds] | method | McNemar p | lost | gained | KV ratio "
        "(fp16) | context only | KV measured |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in verdict.variants.items():
        p, g = s["paired"], s.get("gate") or {}
        # the gate's bound; where it judged no drop (the baseline, CANNOT JUDGE), the fixed-n one, said descriptive
        drop = drop_bound(s) or {"bounds": p["drop_bounds"], "method": f"{p['method']} ({DESCRIPTIVE})"}
        lo, hi = drop["bounds"]
        status = f"{g['status']} (look {g['look']})" if g else "-"
        n = s["n"] if not g or g["contexts"] == s["n"] else f"{s['n']} ({g['contexts']} contexts)"
        lines.append(
            f"| {name} | {status} | {n} | {p['baseline']:.2f} | {p['policy']:.2f} | {p['drop']:+.3f} "
            f"[{signed(lo)}, {signed(hi)}] | {drop['method']} | {p['mcnemar_p']:.3g} | {s['lost']} | {s['gained']} | "
            f"{s['kv_ratio']:.3f}x | {s['kv_ratio_context']:.3f}x | {fmt_bytes(s['kv_bytes'], 'MiB')} "
            f"({s['kv_ratio_measured']:.3f}x) |"
        )
    gib, ctx = t.capacity["gpu_gib"], t.capacity["context"]
    lines += [
        "",
        f"Capacity: sequences of {ctx} tokens that fit in {gib} GiB after the weights, from the KV bytes",
        "per context token as a deployment holds them (fp16/bf16 dense, packed quantized).",
        "",
        "| variant | KV bytes per token | sequences | nominal budget | KV ratio (fp16) | peak KV measured (prefill) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, c in verdict.capacity.items():
        s = verdict.variants[name]
        nominal = "-" if s["nominal_budget"] is None else f"{s['nominal_budget']:g}"
        lines.append(
            f"| {name} | {c['kv_bytes_per_token']:.0f} | {c['sequences']} | {nominal} | "
            f"{s['kv_ratio']:.3f}x | {fmt_bytes(s['peak_prefill_kv_bytes'], 'MiB', 1)} |"
        )
    return lines + chunked_table(verdict.chunked)


def cell_table(cells: list[dict[str, Any]], t: Thresholds) -> list[str]:
    """Markdown: every variant's cells with n, flips, the bounds on the cell's drop and the cell's status."""
    lines = [
        "",
        f"Cells: a cell fails when its accuracy is shown below min_cell_accuracy={t.min_cell_accuracy} at "
        f"{t.confidence:.0%} ({t.multiplicity} across the cells judged); drop bounds one-sided {t.confidence:.0%}.",
        "",
        "| variant | cell | n | baseline | policy | lost | gained | drop [bounds] | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        lo, hi = c["bounds"]
        lines.append(
            f"| {c['variant']} | {c['cell']} | {c['n']} | {c['baseline']:.2f} | {c['policy']:.2f} | {c['lost']} | "
            f"{c['gained']} | [{lo:+.3f}, {hi:+.3f}] | {c['status']} |"
        )
    return lines


def bound_lines(variants: dict[str, Any]) -> list[str]:
    """Each judged variant's status and the drop bound the gate decided on, with its method: the console's one drop
    bound per variant (the run's table above it prints a fixed-n interval, labelled descriptive)."""
    out = []
    for name, s in variants.items():
        bound = drop_bound(s)
        if bound is not None:
            lo, hi = bound["bounds"]
            level = (s.get("gate") or {}).get("level")
            each = f", one-sided {level:.0%} each" if isinstance(level, float) else ""
            drop = f"drop [{signed(lo)}, {signed(hi)}] ({bound['method']}{each})"
            out.append(f"{name}: {s['gate'].get('status')}, {drop}")
    return out


def print_verdict(verdict: Verdict) -> None:
    look = verdict.look.get("look")
    print(f"\nevalkit gate: {headline(verdict)}" + (f" (look {look} of this run)" if look else ""))
    for note in notes(verdict):
        print(f"  - note: {note}")
    for line in search_lines(verdict.search):
        print(f"  - {line}")
    for line in bound_lines(verdict.variants):
        print(f"  - {line}")
    for reason in verdict.reasons:
        print(f"  - {reason}")
    for cell in verdict.not_judged:
        print(f"  - not judged: {cell}")
    if verdict.advice:
        print(f"  - {verdict.advice}")
    if verdict.extend:
        print(f"  - to extend the run: {verdict.extend}")
