"""The report as one self-contained page: the verdict first, the trade-off, where each variant fails, every lost
sample, and each run's own panel (templates/report.html.j2, drawn with Plotly; evalkit.html renders it).

Runs of different tasks, models or backends are merged as the gate merges them (evalkit.records.merged.merge): each
row's label carries the variant as its run recorded it and the (task, model, backend) it is compared within, as
fields, so a variant's name is shown whole and never parsed. Columns every run has sit side by side; each group of
runs (task, model, backend) has its own baseline, so its own Pareto front, accuracy floor and cells panel, laid out
from the cell keys its rows have (context length x depth, RULER's length, a dataset's subtask).
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from evalkit.html import accuracy_colour, figure, write_page
from evalkit.records import BASELINE, Row
from evalkit.records.merged import Group, Label, group_of, is_baseline, label_order, variant_name
from evalkit.records.reading import Records
from evalkit.records.summary import baseline_problems, cell_key, summarize
from evalkit.records.verdict import DESCRIPTIVE, SHOWN_TO_FAIL, signed
from evalkit.report import grid
from evalkit.report.data import VerdictView, row_lines, run_folders, run_panel
from evalkit.report.frontier import search_section
from evalkit.report.lost import lost_samples
from evalkit.thresholds import Thresholds
from evalkit.units import fmt_bytes

SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "pentagon", "hexagon", "triangle-down")
COLOURS = qualitative.Plotly + qualitative.Dark24  # ten well-separated colours first
DODGE = 0.015  # share of KV saved between markers that would sit on one point (about a marker apart)


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points (saved, accuracy, name) not beaten on both axes by another point, by increasing saving."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q[:2] != p[:2] for q in points)]
    return sorted(front)


def short_label(label: str) -> str:
    """A label as its group shows it (the legend and the cells name the group once): the variant as its run recorded
    it, whole, with the run folder that tells apart rows that are not one measurement."""
    if not isinstance(label, Label):
        return label
    return f"{label.name} [{label.folder}]" if label.folder else label.name


def group_titles(rows: list[Row]) -> dict[Group | None, str]:
    """How the tables and the cells name each group of runs: the label prefix that tells the groups apart (`needle`,
    `smollm2-135m`: runs of several tasks or models), else the group's task, model and backend (one task and model
    on several engines); one group of runs: its tasks."""
    prefixes: dict[Group | None, set[str]] = defaultdict(set)
    tasks: dict[Group | None, set[str]] = defaultdict(set)
    for r in rows:
        label = r.variant
        prefixes[group_of(label)].add(label.prefix if isinstance(label, Label) else "")
        tasks[group_of(label)] |= {str(r.task)} if r.task else set()
    shown = {g: next(iter(p)) for g, p in prefixes.items() if len(p) == 1 and "" not in p}
    several = len(prefixes) > 1
    if several and len(shown) == len(prefixes) and len(set(shown.values())) == len(shown):
        return shown
    if several and None not in prefixes:
        return {g: g.title() for g in prefixes}
    return {g: ", ".join(sorted(t)) or "all runs" for g, t in tasks.items()}


def _group_order(group: Group | None) -> tuple:
    return () if group is None else tuple(group)


def plotly_text(text: str) -> str:
    """User text (a variant's name) as Plotly shows it: Plotly reads `<`, `>` and `&` in names and hover texts as its
    own markup, so they are escaped and the name is shown as written."""
    return html.escape(text, quote=False)


def drop_bounds(name: str, s: dict[str, Any], verdict: VerdictView) -> tuple[float, float, str]:
    """(lower, upper, method) of the drop bound a variant is shown with: the gate's, where its verdict judged the
    drop (what it decided on), else the fixed-n paired interval, its method said descriptive."""
    gate = verdict.drop.get(name)
    if gate is not None:
        lo, hi = (float(x) if isinstance(x, (int, float)) else math.nan for x in gate["bounds"])
        return lo, hi, gate["method"]
    lo, hi = s["paired"]["drop_bounds"]
    return lo, hi, f"{s['paired']['method']}, {DESCRIPTIVE}"


def accuracy_bounds(s: dict[str, Any], drop: tuple[float, ...]) -> tuple[float, float]:
    """The variant's accuracy bounds from the drop's `drop` (lower, upper, ...: one-sided each): baseline minus them."""
    p = s["paired"]
    lo, hi = drop[:2]
    if math.isnan(lo) or math.isnan(hi):  # too few samples for a bound (a graded score's bootstrap): none drawn
        return math.nan, math.nan
    return max(0.0, p["baseline"] - hi), min(1.0, p["baseline"] - lo)


# --- the trade-off -----------------------------------------------------------------------------------------------


def _hover(name: str, s: dict[str, Any], verdict: VerdictView, same: list[str]) -> str:
    p, status, drop = s["paired"], verdict.variant_status.get(name, ""), drop_bounds(name, s, verdict)
    lo, hi = accuracy_bounds(s, drop)
    lines = [
        f"<b>{plotly_text(name)}</b>" + (f" ({plotly_text(status)})" if status else ""),
        f"accuracy {s['accuracy']:.3f}" + ("" if is_baseline(name) else f"  bounds [{lo:.3f}, {hi:.3f}]"),
        f"baseline {p['baseline']:.3f} on the same {s['n']} samples",
        f"drop {p['drop']:+.3f} [{signed(drop[0])}, {signed(drop[1])}] ({plotly_text(drop[2])}), lost {s['lost']}, "
        f"gained {s['gained']}",
        f"KV {s['kv_ratio']:.3f}x of the full cache as decoded from ({fmt_bytes(s['kv_bytes_deployed'], 'MiB')} "
        f"deployed; context only {s['kv_ratio_context']:.3f}x)",
    ]
    if s.get("kl_mean") is not None:
        lines.append(f"mean KL {s['kl_mean']:.4f} nats")
    if same:
        lines.append("same point: " + plotly_text(", ".join(same)))
    return "<br>".join(lines)


def tradeoff_figure(summary: dict[str, Any], verdict: VerdictView) -> go.Figure:
    """Accuracy with its bounds against the share of KV bytes saved: one marker per variant (its numbers on hover, its
    name in the legend, never printed over another), a symbol per group of runs (task, model, backend), the Pareto
    front of each group, and the gate's accuracy floor of each group's baseline (baseline minus max_drop): variants
    of different groups were measured against different baselines, so they share neither."""
    fig = go.Figure()
    groups = sorted({group_of(n) for n in summary}, key=_group_order)
    several = len(groups) > 1
    names = sorted({variant_name(n) for n in summary})
    at: dict[tuple, list[str]] = defaultdict(list)
    for name, s in summary.items():
        at[round(1 - s["kv_ratio"], 3), round(s["accuracy"], 3)].append(name)
    for name, s in summary.items():
        group, x, y = group_of(name), 1 - s["kv_ratio"], s["accuracy"]
        lo, hi = accuracy_bounds(s, drop_bounds(name, s, verdict))
        here = at[round(x, 3), round(y, 3)]
        same = [o for o in here if o != name]
        dodge = DODGE * (here.index(name) - (len(here) - 1) / 2)  # markers at one point side by side, centred on it
        fig.add_trace(
            go.Scatter(
                x=[x + dodge],
                y=[y],
                mode="markers",
                name=plotly_text(short_label(name)),
                legendgroup=_legend_group(group),
                legendgrouptitle_text=plotly_text(group.title()) if several and group else None,
                marker={
                    "symbol": SYMBOLS[groups.index(group) % len(SYMBOLS)],
                    "size": 13,
                    "color": COLOURS[names.index(variant_name(name)) % len(COLOURS)],
                    "line": {"width": 1, "color": "#111"},
                },
                error_y=None
                if is_baseline(name) or math.isnan(lo)
                else {"type": "data", "symmetric": False, "array": [hi - y], "arrayminus": [y - lo], "thickness": 1.2},
                hovertext=[_hover(name, s, verdict, same)],
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
    for group in groups:
        members = {n: s for n, s in summary.items() if group_of(n) == group}
        front = pareto([(1 - s["kv_ratio"], s["accuracy"], n) for n, s in members.items()])
        if len(front) > 1:
            fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in front], y=[p[1] for p in front], mode="lines", name="Pareto front",
                    legendgroup=_legend_group(group), line={"dash": "dash", "color": "#6b7280"}, hoverinfo="skip",
                )
            )  # fmt: skip
    for y, titles in _floors(summary, verdict.thresholds).items():
        label = "baseline − max_drop" + (f" ({'; '.join(titles)})" if several and titles else "")
        fig.add_hline(y=y, line={"dash": "dot", "color": "#b91c1c", "width": 1}, annotation_text=plotly_text(label),
                      annotation_font_size=11)  # fmt: skip
    fig.update_xaxes(title="KV bytes saved (share of the full fp16/bf16 cache)", range=[-0.05, 1.05], tickformat=".0%")
    fig.update_yaxes(title=_bars_title(verdict), range=[-0.05, 1.08])
    fig.update_layout(legend={"groupclick": "toggleitem", "itemsizing": "constant"}, hovermode="closest")
    return fig


def _bars_title(verdict: VerdictView) -> str:
    """What the error bars are: the gate's drop bounds where its verdict is shown, else a descriptive interval."""
    if verdict.drop:
        methods = ", ".join(sorted({b["method"] for b in verdict.drop.values()}))
        return f"accuracy (bars: the gate's drop bounds, {methods}, one-sided each)"
    return f"accuracy (bars: {DESCRIPTIVE} fixed-n bounds, not the gate's)"


def _legend_group(group: Group | None) -> str:
    return json.dumps(list(group), ensure_ascii=False) if group else "runs"


def _floors(summary: dict[str, Any], thresholds: dict[str, Any]) -> dict[float, list[str]]:
    """The gate's accuracy floor of each group's baseline (its accuracy minus max_drop) -> the groups at it, each
    named once by its (task, model, backend), one line and one label per height; none for a baseline the gate would
    not judge (below min_baseline_accuracy)."""
    max_drop, weak = thresholds.get("max_drop"), thresholds.get("min_baseline_accuracy")
    if not isinstance(max_drop, (int, float)):
        return {}
    out: dict[float, list[str]] = defaultdict(list)
    for name, s in summary.items():
        if is_baseline(name) and not (isinstance(weak, (int, float)) and s["accuracy"] < weak):
            group = group_of(name)
            titles = out[round(s["accuracy"] - max_drop, 4)]
            if group is not None and group.title() not in titles:
                titles.append(group.title())
    return dict(out)


def kl_figure(summary: dict[str, Any]) -> go.Figure | None:
    """Mean KL against KV bytes saved, for fidelity rows (None when no variant measured it)."""
    points = [(n, s) for n, s in summary.items() if s.get("kl_mean") is not None and not is_baseline(n)]
    if not points:
        return None
    fig = go.Figure()
    for name, s in points:
        shown = plotly_text(name)  # a name is data, never part of the template (`%{...}` in it stays as written)
        fig.add_trace(
            go.Scatter(
                x=[1 - s["kv_ratio"]], y=[s["kl_mean"]], mode="markers", name=shown, marker={"size": 12},
                hovertext=[f"<b>{shown}</b>"],
                hovertemplate="%{hovertext}<br>mean KL %{y:.4f} nats<br>saved %{x:.1%}<extra></extra>",
            )
        )  # fmt: skip
    fig.update_xaxes(title="KV bytes saved", tickformat=".0%", range=[-0.05, 1.05])
    fig.update_yaxes(title="mean KL (nats)", rangemode="tozero")
    return fig


# --- the variants side by side -----------------------------------------------------------------------------------


def variant_table(summary: dict[str, Any], verdict: VerdictView, rows: list[Row]) -> list[dict[str, Any]]:
    """The columns every run has, one line per variant, grouped by run group."""
    titles = group_titles(rows)
    out = []
    for name, s in summary.items():
        p, drop = s["paired"], drop_bounds(name, s, verdict)
        out.append(
            {
                "group": titles[group_of(name)],
                "variant": short_label(name),
                "label": name,
                "baseline": is_baseline(name),
                "status": BASELINE if is_baseline(name) else verdict.variant_status.get(name, "-"),
                "n": s["n"],
                "baseline_accuracy": p["baseline"],
                "accuracy": s["accuracy"],
                "drop": p["drop"],
                "bounds": [signed(drop[0]), signed(drop[1])],
                "method": drop[2],
                "gate_bounds": name in verdict.drop,  # the gate's; else only the descriptive interval is shown
                "descriptive": [signed(x) for x in p["drop_bounds"]],
                "descriptive_method": p["method"],
                "lost": s["lost"],
                "gained": s["gained"],
                "kv_ratio": s["kv_ratio"],
                "kv_measured": fmt_bytes(s["kv_bytes"], "MiB"),
                "kl": s.get("kl_mean"),
            }
        )
    return out


# --- where it fails ----------------------------------------------------------------------------------------------


def _cell(stats: dict | None, status: str, min_base: float | None, baseline_panel: bool) -> dict | None:
    if stats is None:
        return None
    cannot = min_base is not None and stats["baseline"] < min_base
    value = stats["baseline"] if baseline_panel else stats["policy"]
    title = f"accuracy {value:.2f}, n={stats['n']}"
    if not baseline_panel:
        title += f"; baseline {stats['baseline']:.2f}, lost {stats['lost']}, gained {stats['gained']}"
    if cannot:
        title += f"; the baseline scores {stats['baseline']:.2f} here, below min_baseline_accuracy={min_base}"
    elif status:
        title += f"; gate: {status}"
    return {
        "value": value,
        "n": stats["n"],
        "cannot": cannot,
        "failed": status == SHOWN_TO_FAIL,
        "colour": "#e5e7eb" if cannot and not baseline_panel else accuracy_colour(value),
        "title": title,
    }


def cell_panels(rows: list[Row], summary: dict[str, Any], verdict: VerdictView) -> list[dict[str, Any]]:
    """Per group of runs, per variant (the baseline first): accuracy per cell with n, as small grids that wrap."""
    min_base = verdict.thresholds.get("min_baseline_accuracy")
    titles = group_titles(rows)
    status = {(c.get("variant"), c.get("cell")): str(c.get("status", "")) for c in verdict.cells}
    cells_of: dict[Group | None, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        cells_of[group_of(r.variant)].setdefault(cell_key(r.cell), r.cell)
    out = []
    for group, cells in sorted(cells_of.items(), key=lambda item: _group_order(item[0])):
        col, row, facets = grid.axes(list(cells.values()))
        layout = grid.grids(cells, col, row, facets)
        panels = []
        for name in sorted((n for n in summary if group_of(n) == group), key=label_order):
            stats, base = summary[name]["cells"], is_baseline(name)
            grids = [
                {**g, "rows": [
                    {"label": r["label"], "cells": [
                        None if k is None else _cell(stats.get(k), status.get((name, k), ""), min_base, base)
                        for k in r["cells"]
                    ]}
                    for r in g["rows"]
                ]}
                for g in layout
            ]  # fmt: skip
            panels.append({"variant": short_label(name), "baseline": base, "grids": grids})
        out.append({"title": titles[group], "col": col, "row": row, "panels": panels})
    return out


# --- the page ----------------------------------------------------------------------------------------------------


def build(
    run_dirs: list[Path], records: Records, thresholds: Thresholds, verdict: VerdictView, out: Path
) -> dict[str, Any]:
    """Everything report.html.j2 shows, from merged records and the verdict."""
    rows = records.rows
    summary = summarize(rows, label_order)
    # what keeps the gate from judging, unless the verdict already gives it as a reason
    warnings = [w for w in [*records.problems, *baseline_problems(summary, thresholds)[0]] if w not in verdict.reasons]
    lost = lost_samples(rows, row_lines(run_folders(run_dirs)), out)
    kl = kl_figure(summary)
    return {
        "title": "evalkit report: " + ", ".join(d.name for d in run_dirs),
        "generated": datetime.now().isoformat(timespec="seconds"),
        "runs": [str(d) for d in run_dirs],
        "verdict": verdict,
        "warnings": warnings,
        "search": search_section(verdict.search, verdict.thresholds),
        "tradeoff": figure(tradeoff_figure(summary, verdict), "tradeoff-plot", 500),
        "kl": figure(kl, "kl-plot", 380) if kl is not None else None,
        "variants": variant_table(summary, verdict, rows),
        "cells": cell_panels(rows, summary, verdict),
        "lost": lost,
        "filters": {
            "variant": sorted({x["variant"] for x in lost}, key=label_order),
            "cell": sorted({x["cell"] for x in lost}),
            "cause": sorted({x["cause"] for x in lost}),
        },
        "panels": [run_panel(f) for f in run_folders(run_dirs)],
    }


def write(run_dirs: list[Path], records: Records, thresholds: Thresholds, verdict: VerdictView, out: Path) -> Path:
    """Write report.html into `out`."""
    return write_page(out / "report.html", "report.html.j2", **build(run_dirs, records, thresholds, verdict, out))
