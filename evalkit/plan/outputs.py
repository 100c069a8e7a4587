"""The plan's outputs: console tables (rich), plan.json, plan.md, plan.html, the pressure PNG and W&B."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError
from evalkit.plan import page as plan_page
from evalkit.records import to_json, write_atomic
from evalkit.tracking import resolved_mode
from evalkit.units import fmt_bytes

OUTPUTS = ("plan.json", "plan.md", "plan.html", "plan_pressure.png")


def _b(n: float | None) -> str:
    return fmt_bytes(n)  # evalkit.units: the one formatter of byte quantities


def tables(p: dict[str, Any]) -> dict[str, tuple[list[str], list[list[str]]]]:
    """The plan's tables as (header, rows) of strings: the console and plan.md print the same."""
    s = p["settings"]
    pressure_rows = [
        [name, str(pt["batch"]), str(pt["context"]), _b(pt["kv_bytes"]), _b(pt["weights_bytes"]),
         f"{pt['ratio']:.2f}x", pt["bound"]]
        for name, pt in p["pressure"]["points"].items()
    ]  # fmt: skip
    cap = [
        [r["option"], _b(r["kv_bytes_per_sequence"]), str(r["sequences"]),
         "-" if r["gain"] is None else f"{r['gain']:.2f}x", str(r["composed_sequences"]),
         " ".join(x for x in (r.get("status", ""), r.get("why", "")) if x)]
        for r in p["capacity"]
    ]  # fmt: skip
    o = p["offload"]
    offload_rows = [
        [f"{o['link']} ({o['link_gbps']:g} GB/s)", _b(o["kv_step_bytes"]), f"{o['needed_gbps']:.0f} GB/s",
         f"{o['compute_seconds'] * 1e3:.1f} ms", f"{o['link_seconds'] * 1e3:.1f} ms", f"{o['cold_fraction']:.1%}"]
    ]  # fmt: skip
    guide_rows = [[str(i), g["step"], g["because"]] for i, g in enumerate(p["guide"], 1)]
    return {
        "Model": (["", ""], _facts(p)),
        "KV pressure per decode step": (
            ["point", "batch", "context", "KV", "weights", "KV/weights", ""],
            pressure_rows,
        ),
        f"Capacity at {s['context']} tokens": (
            ["option", "KV per sequence", "sequences", "vs full", "composed", "verdict"],
            cap,
        ),
        "Offload at p95 (KV in CPU memory)": (
            ["link", "KV per step", "rate to stream it", "step (GPU reads)", "on the link", "cold share hidden"],
            offload_rows,
        ),
        "Decision guide": (["#", "do", "because"], guide_rows),
    }


def _facts(p: dict[str, Any]) -> list[list[str]]:
    """The model table: architecture, KV bytes per token and sequence, weights, memory free for KV."""
    s, a, kv = p["settings"], p["architecture"], p["kv_bytes_per_token"]
    window = f", sliding window {a['sliding_window']} on {a['sliding_layers']} layers" if a["sliding_window"] else ""
    per_sequence = p["kv_bytes_per_sequence"]
    full = f" (full attention on every layer: {_b(per_sequence['full'])})" if a["sliding_window"] else ""
    return [
        ["model", f"{p['model']} ({p['config_source']})"],
        [
            "attention",
            f"{a['attention']}: {a['layers']} layers, {a['heads']} heads, {a['kv_heads']} KV heads, head_dim "
            f"{a['head_dim']}{window}",
        ],
        [
            "KV bytes per token",
            f"{_b(kv['bf16'])} {s['kv_dtype']}, {_b(kv['fp8'])} FP8, {_b(kv['int4'])} int4 (scales included)",
        ],
        [f"KV per sequence at {s['context']}", f"{_b(per_sequence['as_declared'])}{full}"],
        ["weights", f"{_b(p['weights']['bytes'])} ({p['weights']['source']})"],
        ["free for KV", f"{_b(p['free_bytes'])} of {s['gpu_gib']} GiB x {s['utilization']}"],
    ]


def markdown(p: dict[str, Any]) -> str:
    lines = [f"# evalkit plan: {p['model']}", ""]
    for title, (head, rows) in tables(p).items():
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
        if title.startswith("Offload"):
            lines += ["", f"Verdict: offload is {p['offload']['verdict']}."]
        lines.append("")
    lines += [
        "KV-bound: the batch's KV bytes exceed the weight bytes a decode step reads. Composed: with every lossless",
        "row above (paged, window, prefix caching, FP8); eviction composes with FP8. Measured rows apply the run's KV",
        "ratio (on its model) to this model's full cache, beside the gate's verdict.",
        "",
    ]
    return "\n".join(lines)


def print_console(p: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:  # plain text: plan.md's tables
        print(markdown(p))
        return
    console = Console(width=max(140, Console().width))
    for title, (head, rows) in tables(p).items():  # user text (variants=[snapkv@0.25]) is not Rich markup
        t = Table(title=escape(title), title_justify="left", show_header=any(head))
        for h in head:
            t.add_column(escape(h))
        for r in rows:
            t.add_row(*(escape(str(c)) for c in r))
        console.print(t)
    console.print(f"Offload: {escape(p['offload']['verdict'])}")


def plot(p: dict[str, Any], path: Path) -> None:
    """The crossover curve: for each batch the context at which KV bytes equal weight bytes per decode step (above it:
    KV-bound), and the named operating points labelled with their ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cross = {int(b): c for b, c in p["pressure"]["crossover"].items() if c is not None}
    if cross:
        xs = sorted(cross)
        ax.plot(xs, [cross[x] for x in xs], "k-", label="KV bytes = weight bytes")
        top = max(max(cross.values()), *(pt["context"] for pt in p["pressure"]["points"].values())) * 4
        ax.fill_between(xs, [cross[x] for x in xs], top, color="tab:red", alpha=0.12, label="KV-bound")
    for name, pt in p["pressure"]["points"].items():
        color = "tab:red" if pt["bound"] == "KV-bound" else "tab:blue"
        ax.plot(pt["batch"], pt["context"], "o", color=color)
        ax.annotate(
            f"{name}: {pt['bound']} ({pt['ratio']:.2f}x)",
            (pt["batch"], pt["context"]),
            xytext=(6, 6),
            textcoords="offset points",
            fontsize=9,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("batch (concurrent sequences)")
    ax.set_ylabel("context (tokens)")
    ax.set_title(f"{p['model']}: KV vs weight bytes per decode step ({_b(p['weights']['bytes'])} weights)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(p: dict[str, Any], out: Path) -> list[Path]:
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "plan.json", to_json(p, indent=2, default=str) + "\n")
        write_atomic(out / "plan.md", markdown(p))
        plan_page.write(p, tables(p), out / "plan.html")
        plot(p, out / "plan_pressure.png")
    except OSError as err:
        raise ConfigError(f"cannot write the plan under {out} ({err.strerror or err}); give plan.out=FOLDER") from None
    return [out / name for name in OUTPUTS]


def log_wandb(logger: dict[str, Any], config: dict[str, Any], p: dict[str, Any], out: Path) -> Path:
    """One W&B run for the plan: the KV and capacity figures as metrics, the tables, the pressure PNG. `logger`: the
    logger node (project, entity, group, mode) as plain values; `config`: the plan's whole config, recorded."""
    import wandb

    run = wandb.init(
        project=logger.get("project"),
        entity=logger.get("entity"),
        group=logger.get("group") or "plan",
        name=f"plan-{p['model']}",
        mode=resolved_mode(logger.get("mode") or "auto"),
        dir=str(out),
        config=config,
        reinit="finish_previous",
    )
    metrics = {f"kv_bytes_per_token/{k}": v for k, v in p["kv_bytes_per_token"].items()}
    metrics |= {"weights_bytes": p["weights"]["bytes"], "free_bytes": p["free_bytes"]}
    metrics |= {f"pressure/{k}": v["ratio"] for k, v in p["pressure"]["points"].items()}
    for title, (head, rows) in tables(p).items():
        if title.startswith(("Capacity", "Decision")):
            metrics[title.split(" ")[0].lower()] = wandb.Table(columns=[h or "-" for h in head], data=rows)
    metrics["plots/pressure"] = wandb.Image(str(out / "plan_pressure.png"))
    run.log(metrics)
    local = Path(run.dir).parent
    run.finish()
    return local
