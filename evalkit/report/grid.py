"""The layout of a group's cells panel (evalkit.report.page.cell_panels): context lengths across, depths down, the
other keys that vary faceted into small grids, from the cell keys the rows have."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

LENGTH_KEYS = ("context_length", "max_length", "needle_context_length")  # a cell grid's columns, when rows have one
ROW_KEYS = ("depth", "position")  # and its rows


def _value_order(value: Any) -> tuple:
    """Numbers first in their order, then text: a cell's values sort whatever their kinds."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (not number, value if number else str(value))


def axes(cells: list[dict]) -> tuple[str | None, str | None, list[str]]:
    """(column key, row key, facet keys) for the cells of one group: lengths across, depths down, the rest faceted."""
    common = set.intersection(*(set(c) for c in cells)) if cells else set()
    col = next((k for k in LENGTH_KEYS if k in common), None)
    row = next((k for k in ROW_KEYS if k in common), None)
    varying = sorted(k for k in set().union(*cells) if k not in (col, row) and len({str(c.get(k)) for c in cells}) > 1)
    return col, row, varying


def grids(cells: dict[str, dict], col: str | None, row: str | None, facets: list[str]) -> list[dict]:
    """The layout of one group's cells (their keys in place): one small grid per facet, columns by `col`, rows by
    `row`, or a plain list of cells when neither applies."""
    by_facet: dict[str, dict[str, dict]] = defaultdict(dict)
    for key, c in cells.items():
        by_facet[" ".join(f"{k}={c.get(k)}" for k in facets)][key] = c
    grids = []
    for facet, members in sorted(by_facet.items()):
        if col is None and row is None:
            body = [{"label": k, "cells": [k]} for k in sorted(members)]
            grids.append({"facet": facet, "cols": [""], "rows": body})
            continue
        cols = sorted({c.get(col) for c in members.values()}, key=_value_order) if col else [None]
        ys = sorted({c.get(row) for c in members.values()}, key=_value_order) if row else [None]
        where = {(c.get(row) if row else None, c.get(col) if col else None): k for k, c in members.items()}
        body = [{"label": _label(y), "cells": [where.get((y, x)) for x in cols]} for y in ys]
        grids.append({"facet": facet, "cols": [_label(x) for x in cols], "rows": body})
    return grids


def _label(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)
