"""The validation gate: thresholds on the paired results of one or more runs -> PASS or FAIL, with reasons.

    python -m evalkit.gate results/RUN [results/RUN2 ...] [--gate conf/gate/default.yaml]
    python -m evalkit gate=default policy=snapkv task=needle          # run, then gate

Exit code 0 PASS, 1 FAIL, 2 usage or config error. It fails closed: no baseline, too few samples, a variant whose
measured bytes show no compression although compression was asked, or runs whose model, protocol or library
versions differ are each a FAIL with the reason. Writes verdict.json and report.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from evalkit.analysis import BASELINE, capacity, chunked_vs_oneshot, is_baseline, merge, summarize
from evalkit.errors import ConfigError
from evalkit.records import RUN, SAMPLES, read_rows, write_json

VERDICT, REPORT = "verdict.json", "report.md"


@dataclass
class Thresholds:
    """Conf/gate/*.yaml. None switches a check off."""

    max_drop: float | None = 0.05  # non-inferiority margin on the accuracy drop, judged on the 95% CI upper bound
    max_flip_rate: float | None = 0.10  # lost samples / samples
    min_cell_accuracy: float | None = 0.5  # per cell, where the baseline reaches it
    max_mean_kl: float | None = 0.1  # nats, fidelity rows
    min_samples: int = 20
    min_compression: float = 0.99  # a compressing variant must hold less than this share of the baseline's bytes
    capacity: dict[str, float] = field(default_factory=lambda: {"gpu_gib": 80, "context": 32768})  # report only


@dataclass
class Verdict:
    passed: bool
    reasons: list[str] = field(default_factory=list)
    variants: dict[str, Any] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    capacity: dict[str, Any] = field(default_factory=dict)
    chunked: list[dict[str, Any]] = field(default_factory=list)  # chunked vs one-shot prefill, side by side


def load_thresholds(name_or_path: str) -> Thresholds:
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(str(files("evalkit.conf") / "gate" / f"{name_or_path}.yaml"))
    if not path.is_file():
        raise ConfigError(f"gate {name_or_path!r}: no such gate config (conf/gate/<name>.yaml or a YAML path)")
    return thresholds(OmegaConf.load(path), repr(name_or_path))


def thresholds(node, where: str) -> Thresholds:
    """Thresholds from a gate config (conf/gate/*.yaml, or the run's `gate` node); `where` names it in errors."""
    cfg = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"}
    unknown = set(cfg) - set(Thresholds.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"gate {where}: unknown thresholds {sorted(unknown)}")
    return Thresholds(**cfg)


def read_runs(run_dirs: list[Path]) -> tuple[list[dict], list[dict]]:
    """All rows and run.json files under the given folders (a Hydra multirun folder holds several runs), the rows
    merged into one table with variant labels that keep different measurements apart (see analysis.merge)."""
    runs, infos = [], []
    for d in run_dirs:
        found = [d] if (d / SAMPLES).exists() else sorted(p.parent for p in d.rglob(SAMPLES))
        if not found:
            raise ConfigError(f"{d}: no {SAMPLES} found; give an evalkit run folder (results/...)")
        for run in found:
            info = json.loads((run / RUN).read_text()) if (run / RUN).exists() else {}
            runs.append((run.resolve(), info, read_rows(run / SAMPLES)))
            if info:
                infos.append(info)
    return merge(runs), infos


def _compression_asked(row: dict) -> bool:
    policy = row.get("policy") or {}
    return bool(row.get("quant")) or (
        policy.get("name") not in (None, "none", BASELINE) and policy.get("budget") != 1.0
    )


def judge(rows: list[dict], infos: list[dict], t: Thresholds) -> Verdict:
    """Every reason a variant fails, in words; PASS only when there is none."""
    reasons: list[str] = []
    for key, what in (("protocol", "protocol"), ("versions", "library versions")):
        seen = {json.dumps(_field(i, key), sort_keys=True) for i in infos}
        if len(seen) > 1:
            reasons.append(f"the runs differ in {what} ({len(seen)} different); gate runs of one configuration")
    for name in sorted({(i.get("model") or {}).get("name") for i in infos} - {None}):
        prints = {_field(i, "model") for i in infos if (i.get("model") or {}).get("name") == name}
        if len(prints) > 1:
            reasons.append(f"the runs of model {name} used different weights ({len(prints)} fingerprints)")
    if not rows:
        return Verdict(False, [*reasons, "no records"])
    if not any(is_baseline(r["variant"]) for r in rows):
        reasons.append("no baseline rows: every variant must be compared with the full cache on the same samples")
    summary = summarize(rows)
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    for name, s in summary.items():
        if is_baseline(name):
            continue
        p = s["paired"]
        if s["n"] < t.min_samples:
            reasons.append(f"{name}: {s['n']} samples, fewer than the {t.min_samples} required")
        if t.max_drop is not None and p["drop_ci95"][1] > t.max_drop:
            reasons.append(
                f"{name}: accuracy {p['baseline']:.2f} -> {p['policy']:.2f}; the drop may be as large as "
                f"{p['drop_ci95'][1]:.3f} (95% CI upper bound), over the {t.max_drop} margin"
            )
        rate = s["lost"] / s["n"]
        if t.max_flip_rate is not None and rate > t.max_flip_rate:
            causes = ", ".join(f"{v} {k}" for k, v in sorted(s["flip_causes"].items()))
            reasons.append(
                f"{name}: {s['lost']} of {s['n']} samples flipped from right to wrong ({rate:.0%}, over "
                f"{t.max_flip_rate:.0%})" + (f"; evidence {causes}" if causes else "")
            )
        if t.min_cell_accuracy is not None:
            for cell, c in s["cells"].items():
                if c["baseline"] >= t.min_cell_accuracy > c["policy"]:
                    reasons.append(
                        f"{name}: cell {cell}: accuracy {c['policy']:.2f} (baseline {c['baseline']:.2f}) "
                        f"is below {t.min_cell_accuracy}"
                    )
        over = [
            r
            for r in by_variant[name]
            if r.get("prefill_bound_tokens") is not None and r["prefill_peak_tokens"] > r["prefill_bound_tokens"]
        ]
        if over:
            r = max(over, key=lambda r: r["prefill_peak_tokens"])
            reasons.append(
                f"{name}: the chunked prefill held {r['prefill_peak_tokens']} tokens in a layer, over its bound of "
                f"{r['prefill_bound_tokens']} (budget + chunk), on {len(over)} samples"
            )
        if t.max_mean_kl is not None and s.get("kl_mean") is not None and s["kl_mean"] > t.max_mean_kl:
            reasons.append(f"{name}: mean KL {s['kl_mean']:.4f} nats over {t.max_mean_kl}")
        if any(_compression_asked(r) for r in by_variant[name]) and s["kv_ratio"] >= t.min_compression:
            reasons.append(
                f"{name}: compression was asked but the measured KV bytes are {s['kv_ratio']:.3f}x the baseline's"
            )
    # capacity is a figure per model: with several, each is counted against the largest model's weights
    weights = max((_field(i, "weights") or 0 for i in infos), default=0)
    cap = capacity(summary, weights, float(t.capacity["gpu_gib"]), int(t.capacity["context"]))
    return Verdict(not reasons, reasons, summary, capacity=cap, chunked=chunked_vs_oneshot(rows))


def _field(info: dict, key: str) -> Any:
    if key == "model":
        return (info.get("model") or {}).get("fingerprint")
    if key == "weights":
        return (info.get("model") or {}).get("weights_bytes")
    if key == "versions":
        return {k: v for k, v in (info.get("versions") or {}).items() if k in ("torch", "transformers", "evalkit")}
    return info.get(key)


def write_outputs(verdict: Verdict, out_dir: Path, t: Thresholds) -> None:
    write_json(
        out_dir / VERDICT,
        {
            "verdict": "PASS" if verdict.passed else "FAIL",
            "reasons": verdict.reasons,
            "thresholds": asdict(t),
            "runs": verdict.runs,
            "variants": verdict.variants,
            "chunked_vs_oneshot": verdict.chunked,
        },
    )
    lines = [f"# evalkit gate: {'PASS' if verdict.passed else 'FAIL'}", ""]
    lines += [f"- {r}" for r in verdict.reasons] or ["Every threshold holds."]
    lines += [
        "",
        "| variant | n | baseline | policy | drop [95% CI] | McNemar p | lost | KV ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in verdict.variants.items():
        p = s["paired"]
        lines.append(
            f"| {name} | {s['n']} | {p['baseline']:.2f} | {p['policy']:.2f} | {p['drop']:+.3f} "
            f"[{p['drop_ci95'][0]:+.3f}, {p['drop_ci95'][1]:+.3f}] | {p['mcnemar_p']:.3g} | {s['lost']} | "
            f"{s['kv_ratio']:.3f}x |"
        )
    gib, ctx = t.capacity["gpu_gib"], t.capacity["context"]
    lines += [
        "",
        f"Capacity: sequences of {ctx} tokens that fit in {gib} GiB after the weights, from the KV bytes",
        "per context token measured here (in the run's dtype).",
        "",
        "| variant | KV bytes per token | sequences | nominal budget | measured KV ratio | peak KV (prefill) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, c in verdict.capacity.items():
        s = verdict.variants[name]
        nominal = "-" if s["nominal_budget"] is None else f"{s['nominal_budget']:g}"
        lines.append(
            f"| {name} | {c['kv_bytes_per_token']:.0f} | {c['sequences']} | {nominal} | "
            f"{s['kv_ratio']:.3f}x | {s['peak_prefill_kv_bytes'] / 2**20:.1f} MB |"
        )
    lines += chunked_table(verdict.chunked)
    lines += ["", "Thresholds: " + ", ".join(f"{k}={v}" for k, v in asdict(t).items()), ""]
    (out_dir / REPORT).write_text("\n".join(lines))


def chunked_table(comparisons: list[dict[str, Any]]) -> list[str]:
    """Markdown: each chunked variant beside its one-shot twin (empty when the runs hold none)."""
    if not comparisons:
        return []
    lines = [
        "",
        "Chunked vs one-shot prefill, paired on the same samples (difference = chunked - one-shot).",
        "",
        "| variant | chunk | n | baseline | one-shot | chunked | difference [95% CI] | chunked lost/gained | "
        "peak KV one-shot | peak KV chunked | peak tokens chunked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        lo, hi = c["difference_ci95"]
        lines.append(
            f"| {c['variant']} | {c['chunk']} | {c['n']} | {c['baseline']:.2f} | {c['oneshot']:.2f} | "
            f"{c['chunked']:.2f} | {c['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {c['chunked_lost']}/"
            f"{c['chunked_gained']} | {c['oneshot_peak_kv_bytes'] / 2**20:.2f} MB | "
            f"{c['chunked_peak_kv_bytes'] / 2**20:.2f} MB | {c['chunked_peak_tokens']} |"
        )
    return lines


def gate(run_dirs: list[Path], thresholds: Thresholds, out_dir: Path | None = None) -> Verdict:
    rows, infos = read_runs(run_dirs)
    verdict = judge(rows, infos, thresholds)
    verdict.runs = [str(d) for d in run_dirs]
    write_outputs(verdict, out_dir or run_dirs[0], thresholds)
    return verdict


def print_verdict(verdict: Verdict) -> None:
    print(f"\nevalkit gate: {'PASS' if verdict.passed else 'FAIL'}")
    for reason in verdict.reasons:
        print(f"  - {reason}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evalkit.gate", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="evalkit run folders (or folders holding several)")
    ap.add_argument("--gate", default="default", help="a conf/gate name or a YAML file of thresholds")
    ap.add_argument("--out", type=Path, default=None, help="where verdict.json and report.md go (default: first run)")
    args = ap.parse_args(argv)
    try:
        verdict = gate(args.runs, load_thresholds(args.gate), args.out)
    except ConfigError as err:
        print(f"evalkit: error: {err}", file=sys.stderr)
        return 2
    print_verdict(verdict)
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
