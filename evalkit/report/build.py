"""A report's files: one self-contained HTML page (report.html), Markdown and PNG plots, from one or more runs (a
Hydra multirun folder merges its runs); `python -m evalkit.report` writes them.

report.html (evalkit.report.page): the gate's verdict first (its verdict.json, where it judged exactly these rows;
otherwise "no verdict for these rows" and the gate's command: the report never judges), the trade-off of accuracy
against KV bytes saved, accuracy per cell for every variant, every lost sample with its row in samples.jsonl, and
each run's own panel. report.md and the PNGs (heatmaps, trade-off, easy vs hard, flips by cause) are the static copy
W&B logs. Records the gate cannot judge (repeated, torn or corrupt rows, several runs in one file, no baseline or no
policy rows, a weak baseline, ...) are still drawn, under a list of warnings at the top, also printed on stderr; exit
code 0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from evalkit.errors import ConfigError  # noqa: E402
from evalkit.records import Row
from evalkit.records.merged import group_of, is_baseline, label_order
from evalkit.records.reading import read_runs
from evalkit.records.summary import baseline_problems, chunked_vs_oneshot, summarize
from evalkit.records.verdict import chunked_table, output_folder, signed
from evalkit.report.data import NO_VERDICT, VerdictView, verdict_view
from evalkit.report.page import drop_bounds, pareto
from evalkit.report.page import write as write_page
from evalkit.thresholds import Thresholds, thresholds
from evalkit.units import fmt_bytes  # noqa: E402


def _plain(name: str) -> str:
    """User text (a variant's name) as matplotlib draws it: `$` would start its math markup."""
    return name.replace("$", r"\$")


def _cell(name: str) -> str:
    """User text (a variant's name) safe in a Markdown table cell."""
    return name.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _axes(rows: list[Row]) -> tuple[str, str] | None:
    """The two cell keys a heatmap spans: context length by depth (needle) or by position (middoc)."""
    keys = set().union(*(r.cell for r in rows))
    for y in ("depth", "position"):
        if {"context_length", y} <= keys:
            return "context_length", y
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tick_order(value: Any) -> tuple:
    """Cell values in order: numbers first, by value, then the rest by their text (a cell's values are numbers,
    strings, booleans or null; a JSONL task's meta can make a depth "deep")."""
    return (not _number(value), value if _number(value) else str(value))


def _tick(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)  # an int as written: `:g` overflows past 1e308


def heatmaps(rows: list[Row], out: Path) -> Path | None:
    """Accuracy per (context length, depth or position) for every variant whose rows have both keys: runs of other
    tasks merged into the report (lm-eval's RULER cells, a dataset's subtasks) are left to report.html's panels."""
    axes = _axes(rows)
    if axes is None:
        return None
    xk, yk = axes
    rows = [r for r in rows if xk in r.cell and yk in r.cell]
    variants = sorted({r.variant for r in rows}, key=label_order)
    xs = sorted({r.cell[xk] for r in rows}, key=_tick_order)
    ys = sorted({r.cell[yk] for r in rows}, key=_tick_order)
    fig, axs = plt.subplots(1, len(variants), figsize=(3.2 * len(variants), 3.2), squeeze=False)
    for ax, v in zip(axs[0], variants, strict=True):
        grid = [[float("nan")] * len(xs) for _ in ys]
        for i, y in enumerate(ys):
            for j, x in enumerate(xs):
                scores = [r.score for r in rows if r.variant == v and r.cell[xk] == x and r.cell[yk] == y]
                if scores:
                    grid[i][j] = sum(scores) / len(scores)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(xs)), [_tick(x) for x in xs], rotation=45)
        ax.set_yticks(range(len(ys)), [_tick(y) for y in ys])
        ax.set_xlabel(xk)
        ax.set_ylabel(yk)
        ax.set_title(_plain(v), fontsize=9)
    fig.colorbar(im, ax=axs[0].tolist(), shrink=0.8, label="accuracy")
    path = out / "heatmaps.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def tradeoff(summary: dict[str, Any], out: Path) -> Path:
    """Accuracy (and KL where measured) against the share of KV bytes saved, with the Pareto front of each group of
    runs (task, model, backend: each has its own baseline). Variants are named in the legend, not beside their
    markers: variants at one point would print their names over each other."""
    points = [(1 - s["kv_ratio"], s["accuracy"], name) for name, s in summary.items()]
    has_kl = any("kl_mean" in s for s in summary.values())
    fig, axs = plt.subplots(1, 2 if has_kl else 1, figsize=(12 if has_kl else 8, 4.5), squeeze=False)
    ax = axs[0][0]
    markers = "osD^vP*Xph<>"
    for i, (x, y, name) in enumerate(points):
        ax.scatter([x], [y], marker=markers[i % len(markers)], s=60, alpha=0.8, label=_plain(name))
    for i, group in enumerate(sorted({group_of(n) for n in summary}, key=lambda g: () if g is None else tuple(g))):
        front = pareto([p for p in points if group_of(p[2]) == group])
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="gray", label=None if i else "Pareto front")
    ax.set_xlabel("KV bytes saved (share of the full fp16 cache)")
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if has_kl:
        for i, (n, s) in enumerate((n, s) for n, s in summary.items() if "kl_mean" in s):
            axs[0][1].scatter([1 - s["kv_ratio"]], [s["kl_mean"]], marker=markers[i % len(markers)], label=_plain(n))
        axs[0][1].set_xlabel("KV bytes saved")
        axs[0][1].set_ylabel("mean KL (nats)")
    path = out / "tradeoff.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def bars(summary: dict[str, Any], out: Path) -> list[Path]:
    """Easy vs hard accuracy, and lost samples split by cause (evicted or ignored evidence)."""
    paths = []
    names = [n for n in summary if not is_baseline(n)]
    if any(summary[n]["splits"] for n in names):
        fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
        for k, split in enumerate(("easy", "hard")):
            vals = [summary[n]["splits"].get(split, {}).get("policy", float("nan")) for n in names]
            ax.bar([i + 0.4 * k for i in range(len(names))], vals, width=0.4, label=split)
        ticks = [i + 0.2 for i in range(len(names))]
        ax.set_xticks(ticks, [_plain(n) for n in names], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("accuracy")
        ax.legend()
        paths.append(out / "easy_hard.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    if any(summary[n]["flip_causes"] for n in names):
        fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 4))
        bottom = [0] * len(names)
        for cause in ("evicted", "ignored"):
            vals = [summary[n]["flip_causes"].get(cause, 0) for n in names]
            ax.bar(range(len(names)), vals, bottom=bottom, label=f"evidence {cause}")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylabel("lost samples")
        ax.set_xticks(range(len(names)), [_plain(n) for n in names])
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.legend()
        paths.append(out / "flips.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def markdown(
    summary: dict[str, Any],
    images: list[Path],
    runs: list[Path],
    chunked: list[dict] = (),
    warnings: list[str] = (),
    verdict: VerdictView | None = None,
) -> str:
    lines = ["# evalkit report", ""]
    if warnings:
        lines += ["## Warnings", "", "The gate cannot judge these records; the tables and plots below may mislead.", ""]
        lines += [f"- {w}" for w in warnings] + [""]
    lines += [
        "Runs: " + ", ".join(f"`{r}`" for r in runs),
        "",
        "KV ratio: KV bytes of the cache each answer was decoded from, at its largest (the compressed context, the "
        "question and the answer), over the full cache's on the same request, both as a deployment holds them "
        "(fp16/bf16 dense, quantized packed): what the gate judges; context only: the compressed context right after "
        "compression over the full context's (not judged); KV measured: held here, in the model's own dtype. "
        "Drop bounds: the gate's, from its verdict.json, with the method it decided by; a method marked "
        "descriptive is a fixed-n interval (one-sided 95% each) the gate did not decide on, shown where it judged "
        "no drop.",
        "",
        "| variant | n | baseline | policy | drop [the gate's bounds] | method | McNemar p | lost (evicted/ignored) "
        "| KV ratio (fp16) | context only | KV measured |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    shown = verdict or VerdictView(NO_VERDICT, [], {}, "")
    for name, s in summary.items():
        p, c = s["paired"], s["flip_causes"]
        lo, hi, method = drop_bounds(name, s, shown)
        lines.append(
            f"| {_cell(name)} | {s['n']} | {p['baseline']:.2f} | {p['policy']:.2f} | {p['drop']:+.3f} "
            f"[{signed(lo)}, {signed(hi)}] | {_cell(method)} | {p['mcnemar_p']:.3g} | {s['lost']} "
            f"({c.get('evicted', 0)}/{c.get('ignored', 0)}) | {s['kv_ratio']:.3f}x | {s['kv_ratio_context']:.3f}x | "
            f"{fmt_bytes(s['kv_bytes'], 'MiB')} |"
        )
    lines += chunked_table(list(chunked))
    lines.append("")
    lines += [f"![{img.stem}]({img.name})" for img in images]
    return "\n".join(lines) + "\n"


def report(runs: list[Path], out: Path) -> list[Path]:
    """Write report.html, report.md and the PNG plots into `out`; return the files written. The verdict is the
    gate's verdict.json where it judged these rows (evalkit.report.data.verdict_view). What would keep the gate from
    judging the records is listed as warnings at the top (at the verdict's thresholds, else conf/gate/default.yaml's,
    which Thresholds() holds) and printed on stderr."""
    records = read_runs(runs)
    if not records.rows:
        why = f": {records.problems[0]}" if records.problems else ""
        raise ConfigError(f"no records in {', '.join(map(str, runs))}{why}")
    out = output_folder(out)
    verdict = verdict_view(runs, records)
    t = thresholds(verdict.thresholds, "in verdict.json") if verdict.thresholds else Thresholds()
    summary = summarize(records.rows, label_order)
    warnings = [*records.problems, *baseline_problems(summary, t)[0]]
    for w in warnings:
        print(f"evalkit report: warning: {w}", file=sys.stderr)
    page = write_page(runs, records, t, verdict, out)
    try:
        images = [
            p for p in [heatmaps(records.rows, out), tradeoff(summary, out), *bars(summary, out)] if p is not None
        ]
        md = markdown(summary, images, runs, chunked_vs_oneshot(records.rows), warnings, verdict)
        (out / "report.md").write_text(md)
    except OSError as err:
        raise ConfigError(
            f"could not write the report into {out} ({err.strerror or err}); give --out another folder"
        ) from None
    return [page, out / "report.md", *images]
