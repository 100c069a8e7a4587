"""Reports: Markdown and HTML with PNG plots, from one or more runs (a Hydra multirun folder merges its runs).

    python -m evalkit.report results/RUN [results/RUN2 ...] [--out DIR]

Plots: accuracy per cell (context length x depth or position) per variant beside the baseline; accuracy (and
KL, for fidelity) against the share of KV bytes saved, with the Pareto front; easy vs hard; flips by cause.
Records the gate cannot judge (repeated, torn or corrupt rows, several runs in one file, no baseline or no policy
rows, a weak baseline, ...) are still drawn, under a list of warnings at the top, also printed on stderr; exit code 0.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from evalkit.analysis import chunked_vs_oneshot, is_baseline, label_order, summarize  # noqa: E402
from evalkit.cli import guarded  # noqa: E402
from evalkit.errors import ConfigError  # noqa: E402
from evalkit.gate import (  # noqa: E402
    Thresholds,
    baseline_problems,
    chunked_table,
    load_thresholds,
    output_folder,
    read_runs,
)
from evalkit.units import fmt_bytes  # noqa: E402


def pareto(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points (saved, accuracy, name) not beaten on both axes by another point, by increasing saving."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q[:2] != p[:2] for q in points)]
    return sorted(front)


def _axes(rows: list[dict]) -> tuple[str, str] | None:
    """The two cell keys a heatmap spans: context length by depth (needle) or by position (middoc)."""
    keys = set().union(*(r["cell"] for r in rows))
    for y in ("depth", "position"):
        if {"context_length", y} <= keys:
            return "context_length", y
    return None


def heatmaps(rows: list[dict], out: Path) -> Path | None:
    axes = _axes(rows)
    if axes is None:
        return None
    xk, yk = axes
    variants = sorted({r["variant"] for r in rows}, key=label_order)
    xs = sorted({r["cell"][xk] for r in rows})
    ys = sorted({r["cell"][yk] for r in rows})
    fig, axs = plt.subplots(1, len(variants), figsize=(3.2 * len(variants), 3.2), squeeze=False)
    for ax, v in zip(axs[0], variants, strict=True):
        grid = [[float("nan")] * len(xs) for _ in ys]
        for i, y in enumerate(ys):
            for j, x in enumerate(xs):
                scores = [r["score"] for r in rows if r["variant"] == v and r["cell"][xk] == x and r["cell"][yk] == y]
                if scores:
                    grid[i][j] = sum(scores) / len(scores)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=45)
        ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
        ax.set_xlabel(xk)
        ax.set_ylabel(yk)
        ax.set_title(v, fontsize=9)
    fig.colorbar(im, ax=axs[0].tolist(), shrink=0.8, label="accuracy")
    path = out / "heatmaps.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def tradeoff(summary: dict[str, Any], out: Path) -> Path:
    """Accuracy (and KL where measured) against the share of KV bytes saved, with the Pareto front."""
    points = [(1 - s["kv_ratio"], s["accuracy"], name) for name, s in summary.items()]
    has_kl = any("kl_mean" in s for s in summary.values())
    fig, axs = plt.subplots(1, 2 if has_kl else 1, figsize=(11 if has_kl else 6, 4.5), squeeze=False)
    ax = axs[0][0]
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    for x, y, name in points:
        ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = pareto(points)
    ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="gray", label="Pareto front")
    ax.set_xlabel("KV bytes saved (share of the full fp16 cache)")
    ax.set_ylabel("accuracy")
    ax.legend(fontsize=8)
    if has_kl:
        kl = [(1 - s["kv_ratio"], s["kl_mean"], n) for n, s in summary.items() if "kl_mean" in s]
        axs[0][1].scatter([p[0] for p in kl], [p[1] for p in kl], color="tab:red")
        for x, y, name in kl:
            axs[0][1].annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
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
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
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
            ax.bar(names, vals, bottom=bottom, label=f"evidence {cause}")
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_ylabel("lost samples")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        ax.legend()
        paths.append(out / "flips.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def markdown(
    summary: dict[str, Any], images: list[Path], runs: list[Path], chunked: list[dict] = (), warnings: list[str] = ()
) -> str:
    lines = ["# evalkit report", ""]
    if warnings:
        lines += ["## Warnings", "", "The gate cannot judge these records; the tables and plots below may mislead.", ""]
        lines += [f"- {w}" for w in warnings] + [""]
    lines += [
        "Runs: " + ", ".join(f"`{r}`" for r in runs),
        "",
        "KV ratio: KV bytes over the full cache's, both as a deployment holds them (fp16/bf16 dense, quantized "
        "packed); KV measured: held here, in the model's own dtype. Drop bounds: one-sided 95% each.",
        "",
        "| variant | n | baseline | policy | drop [95% bounds] | McNemar p | lost (evicted/ignored) | KV ratio (fp16) "
        "| KV measured |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        p, c = s["paired"], s["flip_causes"]
        lines.append(
            f"| {name} | {s['n']} | {p['baseline']:.2f} | {p['policy']:.2f} | {p['drop']:+.3f} "
            f"[{p['drop_bounds'][0]:+.3f}, {p['drop_bounds'][1]:+.3f}] | {p['mcnemar_p']:.3g} | {s['lost']} "
            f"({c.get('evicted', 0)}/{c.get('ignored', 0)}) | {s['kv_ratio']:.3f}x | "
            f"{fmt_bytes(s['kv_bytes'], 'MiB')} |"
        )
    lines += chunked_table(list(chunked))
    lines.append("")
    lines += [f"![{img.stem}]({img.name})" for img in images]
    return "\n".join(lines) + "\n"


def to_html(md: str) -> str:
    """A small HTML page for the Markdown above (tables and images), with no dependency."""
    body, table = [], []
    for line in md.splitlines():
        if line.startswith("|"):
            if set(line) <= set("|-: "):
                continue
            cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
            tag = "th" if not table else "td"
            table.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if table:
            body.append("<table border=1 cellpadding=4>" + "".join(table) + "</table>")
            table = []
        if line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("!["):
            src = line[line.index("(") + 1 : -1]
            body.append(f'<p><img src="{html.escape(src)}"></p>')
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    if table:
        body.append("<table border=1 cellpadding=4>" + "".join(table) + "</table>")
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>evalkit report</title></head><body>"
        + "".join(body)
        + "</body></html>\n"
    )


def report(runs: list[Path], out: Path, thresholds: Thresholds | None = None) -> list[Path]:
    """Write report.md, report.html and the PNG plots into `out`; return the files written. What would keep the gate
    (with `thresholds`, default conf/gate/default.yaml) from judging the records is listed as warnings at the top of
    the report and printed on stderr."""
    records = read_runs(runs)
    if not records.rows:
        why = f": {records.problems[0]}" if records.problems else ""
        raise ConfigError(f"no records in {', '.join(map(str, runs))}{why}")
    out = output_folder(out)
    summary = summarize(records.rows)
    warnings = [*records.problems, *baseline_problems(summary, thresholds or load_thresholds("default"))[0]]
    for w in warnings:
        print(f"evalkit report: warning: {w}", file=sys.stderr)
    try:
        images = [
            p for p in [heatmaps(records.rows, out), tradeoff(summary, out), *bars(summary, out)] if p is not None
        ]
        md = markdown(summary, images, runs, chunked_vs_oneshot(records.rows), warnings)
        (out / "report.md").write_text(md)
        (out / "report.html").write_text(to_html(md))
    except OSError as err:
        raise ConfigError(
            f"could not write the report into {out} ({err.strerror or err}); give --out another folder"
        ) from None
    return [out / "report.md", out / "report.html", *images]


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        ap = argparse.ArgumentParser(prog="python -m evalkit.report", description=__doc__.splitlines()[0])
        ap.add_argument("runs", nargs="+", type=Path)
        ap.add_argument("--out", type=Path, default=None, help="output folder (default: RUN/report)")
        args = ap.parse_args(argv)
        written = report(args.runs, args.out or args.runs[0] / "report")
        print("\n".join(str(p) for p in written))
        return 0

    return guarded(run)


if __name__ == "__main__":
    raise SystemExit(main())
