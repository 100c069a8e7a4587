"""Self-contained HTML pages (the report, the plan): Jinja2 templates with Plotly's JavaScript inlined.

A page opens offline, from a file, with no network: the stylesheet lives in the template and plotly.js (the copy the
installed `plotly` package ships) is written into the page once. Figures are Plotly figures serialised to JSON and
drawn by that copy; everything else is HTML, so a page without JavaScript still shows the verdict and the tables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import plotly
import plotly.graph_objects as go
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup
from plotly.offline import get_plotlyjs

from evalkit.errors import ConfigError
from evalkit.records import write_atomic

# One look for every page: the palette of accuracy from 0 (red) to 1 (green), and the figures' defaults.
PLOT_CONFIG = {"displaylogo": False, "responsive": True, "toImageButtonOptions": {"format": "png", "scale": 2}}
LAYOUT = {
    "template": "plotly_white",
    "margin": {"l": 60, "r": 20, "t": 40, "b": 50},
    "font": {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 13},
    "hoverlabel": {"align": "left"},
}

_env = Environment(
    loader=PackageLoader("evalkit", "templates"),
    autoescape=select_autoescape(["html", "j2"]),
    undefined=StrictUndefined,  # a name the page uses but was not given is an error here, not a blank on the page
    trim_blocks=True,
    lstrip_blocks=True,
)


def accuracy_colour(value: float | None) -> str:
    """A background for an accuracy in [0, 1]: red (0) through amber to green (1); grey when there is none."""
    if value is None or value != value:  # None or NaN
        return "#e5e7eb"
    hue = 120 * max(0.0, min(1.0, value))
    return f"hsl({hue:.0f}, 70%, 78%)"


def figure_json(fig: go.Figure) -> Markup:
    """A figure as JSON that is safe inside a <script> element (no `</` can close it early)."""
    return Markup(fig.to_json().replace("</", "<\\/"))


def figure(fig: go.Figure, div_id: str, height: int = 460) -> dict[str, Any]:
    """What the templates' `plot` macro draws: the element's id, its height and the figure."""
    fig.update_layout(**LAYOUT, height=height)
    return {"id": div_id, "height": height, "json": figure_json(fig)}


def _json(value: Any) -> Markup:
    return Markup(json.dumps(value, default=str).replace("</", "<\\/"))


_env.filters["colour"] = accuracy_colour
_env.filters["tojson_safe"] = _json


def render(template: str, **context: Any) -> str:
    """The page `template` (templates/*.html.j2) with `context`, plotly.js inlined."""
    return _env.get_template(template).render(
        plotly_js=Markup(get_plotlyjs()), plotly_version=plotly.__version__, plot_config=_json(PLOT_CONFIG), **context
    )


def write_page(path: Path, template: str, **context: Any) -> Path:
    """Render and write a page atomically; a ConfigError naming the file when it cannot be written."""
    text = render(template, **context)
    try:
        write_atomic(path, text)
    except OSError as err:
        raise ConfigError(f"could not write {path} ({err.strerror or err}); give --out another folder") from None
    return path
