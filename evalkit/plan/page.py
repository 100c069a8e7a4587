"""The plan as one self-contained page (templates/plan.html.j2): its tables and an interactive pressure plot.

Takes the plan dict and its tables as evalkit.plan builds them, so the arithmetic stays in evalkit.plan and this
module only draws it (the same tables as plan.md and the console, the same crossover as plan_pressure.png).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from evalkit.html import figure, write_page
from evalkit.units import fmt_bytes


def pressure_figure(p: dict[str, Any]) -> go.Figure:
    """Per batch, the context where the batch's KV bytes equal the weight bytes a decode step reads (above it, the
    shaded region, decode is KV-bound), and the plan's operating points; everything named on hover and in the legend."""
    fig = go.Figure()
    cross = sorted((int(b), c) for b, c in p["pressure"]["crossover"].items() if c is not None)
    points = p["pressure"]["points"]
    if cross:
        xs, ys = [b for b, _ in cross], [c for _, c in cross]
        top = max([*ys, *(pt["context"] for pt in points.values())]) * 4
        fig.add_trace(go.Scatter(x=xs, y=[top] * len(xs), mode="lines", line={"width": 0}, showlegend=False,
                                 hoverinfo="skip"))  # fmt: skip
        fig.add_trace(
            go.Scatter(
                x=xs, y=ys, mode="lines+markers", name="KV bytes = weight bytes", fill="tonexty",
                fillcolor="rgba(220, 38, 38, 0.12)", line={"color": "#111"}, marker={"size": 5},
                hovertemplate="batch %{x}: KV-bound above %{y:,.0f} tokens<extra></extra>",
            )
        )  # fmt: skip
    at: dict[tuple, list[str]] = defaultdict(list)
    for name, pt in points.items():
        at[pt["batch"], pt["context"]].append(name)
    for (batch, context), names in at.items():
        pt = points[names[0]]
        text = (
            f"<b>{', '.join(names)}</b><br>batch {batch}, context {context:,} tokens<br>KV per step "
            f"{fmt_bytes(pt['kv_bytes'])} vs weights {fmt_bytes(pt['weights_bytes'])}: {pt['ratio']:.2f}x "
            f"({pt['bound']})"
        )
        fig.add_trace(
            go.Scatter(
                x=[batch], y=[context], mode="markers", name=f"{', '.join(names)}: {pt['bound']} ({pt['ratio']:.2f}x)",
                marker={"size": 13, "color": "#dc2626" if pt["bound"] == "KV-bound" else "#2563eb",
                        "line": {"width": 1, "color": "#111"}},
                hovertext=[text], hovertemplate="%{hovertext}<extra></extra>",
            )
        )  # fmt: skip
    fig.update_xaxes(type="log", title="batch (concurrent sequences)", dtick=0.30103, tickformat="d")
    fig.update_yaxes(type="log", title="context (tokens)", dtick=0.30103, tickformat=",d")
    fig.update_layout(
        title=f"{p['model']}: KV vs weight bytes per decode step ({fmt_bytes(p['weights']['bytes'])} weights)",
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def write(p: dict[str, Any], tables: dict[str, tuple[list[str], list[list[str]]]], path: Path) -> Path:
    """Write plan.html: the plan's tables (as `tables` gives them) and its pressure plot."""
    return write_page(
        path,
        "plan.html.j2",
        title=f"evalkit plan: {p['model']}",
        plan=p,
        tables=[{"title": t, "head": head, "rows": rows} for t, (head, rows) in tables.items()],
        pressure=figure(pressure_figure(p), "pressure-plot", 520),
    )
