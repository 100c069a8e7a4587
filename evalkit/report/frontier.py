"""A budget search's answer on the report page: the safe frontier of each policy, from the gate's verdict.json
`search` (evalkit.gate.search), shown only where evalkit.records.shown says that verdict is the gate's for these rows.

The figure: x the KV ratio of the cache each answer was decoded from (each step's kv_ratio, the budget beside its
point), y the drop with the gate's bounds, the margin (max_drop) as a line, one trace per policy, the safe budget
marked with a star and the first budget not shown safe with a cross and why. Beside it each policy's statement and
what its safe budget buys (its capacity text), as text. Nothing here judges: every status and word is the gate's.
"""

from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from evalkit.html import figure
from evalkit.records.verdict import signed

NOT_TESTED = "NOT TESTED"  # evalkit.gate.search.NOT_TESTED: a budget the search never reached
SYMBOL = {"PASS": "circle", "INCONCLUSIVE": "circle-open", "FAIL": "x", NOT_TESTED: "circle-open-dot"}
WHY_CHARS = 90  # the first `why` of the first budget not shown safe, cut here on the figure (whole in its hover)


def _number(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _text(text: str) -> str:
    """User text (a policy's name) as Plotly shows it: `<`, `>` and `&` are its markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _why(step: dict[str, Any]) -> str:
    """A step's status and the first reason the gate gave for it, the variant's name it starts with left off."""
    why = [str(w) for w in step.get("why") or []]
    first = why[0] if why else ""
    prefix = f"{step.get('variant')}: "
    first = first[len(prefix) :] if first.startswith(prefix) else first
    return f"{step.get('status')}: {first}" if first else str(step.get("status"))


def _hover(chain: str, step: dict[str, Any]) -> str:
    lo, hi = (list(step.get("drop_bounds") or []) + [None, None])[:2]
    lines = [
        f"<b>{_text(chain)} at {step.get('budget')}</b> ({_text(str(step.get('status')))})",
        f"drop {_number(step.get('drop')):+.3f} [{signed(lo)}, {signed(hi)}] (the gate's bounds), n {step.get('n')}",
        f"accuracy {_number(step.get('accuracy')):.3f}, baseline {_number(step.get('baseline_accuracy')):.3f}",
        f"KV {_number(step.get('kv_ratio')):.3f}x as decoded from "
        f"(context only {_number(step.get('kv_ratio_context')):.3f}x)",
    ]
    lines += [_text(str(w)) for w in step.get("why") or []][:2]
    return "<br>".join(lines)


def _bars(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The gate's drop bounds as error bars (none for a budget not tested: the search never decided on it)."""
    up, down = [], []
    for s in steps:
        lo, hi = (list(s.get("drop_bounds") or []) + [None, None])[:2]
        drop, tested = _number(s.get("drop")), s.get("status") != NOT_TESTED
        up.append(_number(hi) - drop if tested else math.nan)
        down.append(drop - _number(lo) if tested else math.nan)
    return {"type": "data", "symmetric": False, "array": up, "arrayminus": down, "thickness": 1.2}


def frontier_figure(search: dict[str, Any], max_drop: Any) -> go.Figure:
    """The safe frontier of every policy searched (see the module's docstring)."""
    fig = go.Figure()
    for i, (chain, entry) in enumerate(search["policies"].items()):
        colour = qualitative.Plotly[i % len(qualitative.Plotly)]
        steps = list(entry.get("steps") or [])
        fig.add_trace(
            go.Scatter(
                x=[_number(s.get("kv_ratio")) for s in steps],
                y=[_number(s.get("drop")) for s in steps],
                mode="lines+markers+text",
                name=_text(chain),
                legendgroup=chain,
                text=[str(s.get("budget")) for s in steps],
                textposition="top center",
                line={"color": colour},
                marker={"size": 11, "color": colour, "symbol": [SYMBOL.get(s.get("status"), "circle") for s in steps]},
                error_y=_bars(steps),
                hovertext=[_hover(chain, s) for s in steps],
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
        _mark(fig, chain, entry, steps, colour)
    if isinstance(max_drop, (int, float)) and not isinstance(max_drop, bool):
        fig.add_hline(y=max_drop, line={"dash": "dot", "color": "#b91c1c", "width": 1},
                      annotation_text=f"margin: max_drop = {max_drop:g}", annotation_font_size=11)  # fmt: skip
    fig.update_xaxes(title="KV ratio of the cache decoded from (× the full cache; the budget beside each point)",
                     autorange="reversed")  # fmt: skip
    fig.update_yaxes(title="accuracy drop (bars: the gate's bounds, one-sided each)")
    fig.update_layout(hovermode="closest", legend={"groupclick": "togglegroup"})
    return fig


def _mark(fig: go.Figure, chain: str, entry: dict[str, Any], steps: list[dict[str, Any]], colour: str) -> None:
    """The safe budget (a star) and the first budget not shown safe (a cross, its status and first `why` beside)."""
    by_variant = {s.get("variant"): s for s in steps}
    safe, first = by_variant.get(entry.get("safe_variant")), by_variant.get(entry.get("first_not_safe"))
    if safe is not None:
        fig.add_trace(
            go.Scatter(
                x=[_number(safe.get("kv_ratio"))], y=[_number(safe.get("drop"))], mode="markers",
                name=_text(f"{chain}: safe budget {entry.get('safe_budget')}"), legendgroup=chain,
                marker={"symbol": "star", "size": 20, "color": colour, "line": {"width": 1, "color": "#111"}},
                hovertext=[_text(str(entry.get("statement")))], hovertemplate="%{hovertext}<extra></extra>",
            )
        )  # fmt: skip
    if first is not None:
        why = _why(first)
        fig.add_trace(
            go.Scatter(
                x=[_number(first.get("kv_ratio"))], y=[_number(first.get("drop"))], mode="markers",
                name=_text(f"{chain}: {first.get('budget')} not shown safe"), legendgroup=chain,
                marker={"symbol": "x-thin-open", "size": 22, "color": "#b91c1c", "line": {"width": 2}},
                hovertext=[_text(why)], hovertemplate="%{hovertext}<extra></extra>",
            )
        )  # fmt: skip
        short = why if len(why) <= WHY_CHARS else why[: WHY_CHARS - 1] + "…"
        fig.add_annotation(x=_number(first.get("kv_ratio")), y=_number(first.get("drop")), text=_text(short),
                           showarrow=True, arrowhead=2, ax=0, ay=40, font={"size": 10, "color": "#b91c1c"})  # fmt: skip


def _entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A policy's entry with only its steps that are objects (verdict.json is the gate's: this keeps a page from
    failing on a hand-edited one, which evalkit.records.shown does not vouch for field by field)."""
    steps = entry.get("steps") if isinstance(entry.get("steps"), list) else []
    return {**entry, "steps": [s for s in steps if isinstance(s, dict)]}


def search_section(search: Any, thresholds: dict[str, Any]) -> dict[str, Any] | None:
    """What report.html.j2's search section shows: the procedure, each policy's status, statement, safe budget and
    capacity text, and the figure; None where the verdict shown has no search."""
    if not isinstance(search, dict) or not isinstance(search.get("policies"), dict) or not search["policies"]:
        return None
    search = {**search, "policies": {k: _entry(v) for k, v in search["policies"].items() if isinstance(v, dict)}}
    policies = []
    for chain, entry in search["policies"].items():
        capacity = entry.get("capacity") if isinstance(entry.get("capacity"), dict) else None
        first = next((s for s in entry.get("steps") or [] if s.get("variant") == entry.get("first_not_safe")), None)
        policies.append(
            {
                "policy": chain,
                "status": str(entry.get("status")),
                "safe_budget": entry.get("safe_budget"),
                "statement": str(entry.get("statement")),
                "capacity": str(capacity.get("text")) if capacity else None,
                "first_not_safe": _why(first) if first else None,
            }
        )
    height = 460 + 20 * len(policies)
    return {
        "procedure": str(search.get("procedure") or ""),
        "policies": policies,
        "figure": figure(frontier_figure(search, thresholds.get("max_drop")), "frontier-plot", height),
    }
