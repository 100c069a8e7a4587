"""The plan itself: weights, the capacity table (each option alone and composed), and the decision guide as one
ordered recommendation, each step with the number behind it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evalkit.arch import Arch, arch_from_config, element_bytes, format_bytes, kv_bytes_per_sequence
from evalkit.capacity import free_bytes, sequences
from evalkit.modelspec import ModelSpec
from evalkit.params import count_params
from evalkit.plan.measured import measured_variants
from evalkit.plan.pressure import BATCHES, LINKS, crossover_context, offload, pressure
from evalkit.plan.settings import Settings
from evalkit.sources import Source, model_label, read_source
from evalkit.units import GiB


def weights(arch: Arch, source: Source, s: Settings) -> dict[str, Any]:
    """The weight bytes served: plan.weights_gib, else the parameter count (file metadata where present, else the
    config) at plan.weight_dtype; and the parameters a token activates (MoE)."""
    total, active = count_params(arch)
    if s.weights_gib is not None:
        return {"bytes": s.weights_gib * GiB, "source": "plan.weights_gib", "params": None, "active_params": None}
    params, where = source.params or (total, "computed from the config")
    return {
        "bytes": params * element_bytes(s.weight_dtype),
        "source": f"{where}, at {s.weight_dtype}",
        "params": params,
        "params_from_config": total,
        "active_params": active if active != total else None,
    }


def capacity_rows(arch: Arch, s: Settings, free: float, measured: list[dict]) -> list[dict[str, Any]]:
    """The capacity table at plan.context, in the decision guide's order, each option alone and composed with the
    lossless ones above it: paged KV, the sliding window, prefix caching, FP8 KV; int4 instead of FP8; eviction on top
    of them. Rows from run folders use their variants' measured KV ratio."""
    ctx, e = s.context, format_bytes(arch, "bf16", s.kv_dtype)
    full = kv_bytes_per_sequence(arch, ctx, e, window=False)
    rows: list[dict[str, Any]] = []

    def row(option: str, alone: float, composed: float, shared_alone: float = 0.0, shared: float = 0.0, **extra):
        rows.append(
            {
                "option": option,
                "kv_bytes_per_sequence": alone,
                "sequences": sequences(free, alone, shared_alone),
                "composed_kv_bytes_per_sequence": composed,
                "composed_sequences": sequences(free, composed, shared),
                **extra,
            }
        )

    reserve = arch.max_context or ctx
    contiguous = kv_bytes_per_sequence(arch, max(reserve, ctx), e, window=False)
    row(f"contiguous, reserved at max context {max(reserve, ctx)}", contiguous, contiguous)
    row(f"full cache {s.kv_dtype} (paged)", full, full)
    window = kv_bytes_per_sequence(arch, ctx, e)
    chain = full
    if arch.window:
        chain = window
        row(f"sliding window {arch.window} on {arch.sliding_layers}/{arch.layers} layers", window, chain)
    h = s.prefix_hit_rate
    if h > 0:
        row(f"prefix caching at {h:.0%} hit rate", full, chain, h, h)
    fp8 = format_bytes(arch, "fp8") / e
    row("FP8 KV (e4m3, fp16 scales)", full * fp8, chain * fp8, 0, h)
    int4 = format_bytes(arch, "int4") / e
    row("int4 KV (KIVI, group 64) instead of FP8", full * int4, chain * int4, 0, h)
    for b in s.budgets:
        alone = kv_bytes_per_sequence(arch, ctx, e, window=False, budget=b)
        composed = kv_bytes_per_sequence(arch, ctx, fp8 * e, window=True, budget=b)
        row(f"eviction at budget {b:g} (not validated)", alone, composed, 0, h, status="not validated")
    for m in measured:
        r = m["kv_ratio"]
        row(
            f"{m['variant']} (measured {r:.3f}x on {m['model']})",
            full * r,
            chain * r,
            0,
            h,
            status=m["status"],
            why=m["why"],
            run=m["run"],
        )
    base = rows[1]["sequences"]
    for r in rows:
        r["gain"] = r["sequences"] / base if base else None
    return rows


def _step(step: str, because: str) -> dict[str, str]:
    return {"step": step, "because": because}


def guide(arch: Arch, s: Settings, w: float, free: float, points: dict, rows: list[dict], measured: list) -> list:
    """The decision guide as one ordered recommendation, each step with the number that triggered it."""
    p95 = points["p95"]
    full_fit = sequences(free, kv_bytes_per_sequence(arch, p95["context"], format_bytes(arch, "bf16", s.kv_dtype)))
    at_p95 = f"at p95 (batch {s.batch}, {p95['context']} tokens) KV is {p95['ratio']:.2f}x the weights per decode step"
    if free <= 0:
        room = f"the weights ({w / GiB:.1f} GiB) leave no room in {s.gpu_gib} GiB x {s.utilization}"
        return [_step("quantize weights first", room)]
    if p95["ratio"] < 1 and full_fit >= s.batch:
        fits = f"{at_p95}, and {full_fit} sequences of the full cache fit (>= batch {s.batch})"
        return [_step("stop: KV is not the bottleneck", fits)]
    if p95["ratio"] < 1:
        steps = [
            _step(
                "quantize weights first",
                f"weights ({w / GiB:.1f} GiB) exceed the KV read per step at p95 ({p95['kv_bytes'] / GiB:.1f} GiB, "
                f"{p95['ratio']:.2f}x): they dominate memory and bandwidth",
            )
        ]
    else:
        steps = [_step("KV is the bottleneck", f"{at_p95}; {full_fit} sequences of the cache as declared fit there")]
    steps, done = _memory_steps(steps, s, rows)
    if done:
        return [*steps, _step("stop: no eviction needed", f"batch {s.batch} fits after the steps above")]
    return [*steps, _eviction_step(s, measured)]


def _memory_steps(steps: list[dict], s: Settings, rows: list[dict]) -> tuple[list[dict], bool]:
    """Paged KV, then the sliding window, prefix caching and FP8 KV while the batch does not fit; whether it fits."""
    by = {r["option"].split(" ")[0]: r for r in rows}
    contiguous, paged = rows[0], rows[1]
    because = f"{contiguous['sequences']} -> {paged['sequences']} sequences at {s.context} tokens"
    steps = [*steps, _step("paged KV", because + " (allocate what a sequence holds, not its max context)")]
    done = paged["sequences"] >= s.batch
    for key, name in (("sliding", "sliding window"), ("prefix", "prefix caching"), ("FP8", "FP8 KV")):
        if done or key not in by:
            continue
        r = by[key]
        composed = f"{r['composed_sequences']} sequences composed with the steps above ({r['gain']:.2f}x alone)"
        steps.append(_step(name, composed))
        done = r["composed_sequences"] >= s.batch
    return steps, done


def _eviction_step(s: Settings, measured: list) -> dict[str, str]:
    """Eviction as the last step: the variant that PASSED the gate and keeps least, or a validation first."""
    passed = [m for m in measured if m["status"] == "PASS"]
    if passed:
        best = max(passed, key=lambda m: 1 / m["kv_ratio"])
        return _step(
            f"eviction: {best['variant']} (PASSED the gate)",
            f"still short of batch {s.batch}; it holds {best['kv_ratio']:.3f}x the KV ({best['run']})",
        )
    return _step(
        "eviction, only with validation",
        f"still short of batch {s.batch} after FP8 KV; validate a policy first: python -m evalkit "
        "gate=default variants=[snapkv@0.25] (no variant given here has PASSED)",
    )


def make_plan(model: ModelSpec, s: Settings) -> dict[str, Any]:
    """The whole plan of `model` at these settings: what plan.json holds and every output shows."""
    source = read_source(model)
    arch = arch_from_config(source.raw, model_label(model))
    if arch.max_context and s.p95_context > arch.max_context:
        s.p95_context = int(arch.max_context)
    w = weights(arch, source, s)
    free = free_bytes(s.gpu_gib, w["bytes"], s.utilization)
    e = format_bytes(arch, "bf16", s.kv_dtype)
    points = {
        "p50": pressure(arch, w["bytes"], s.batch, s.context, e),
        "p95": pressure(arch, w["bytes"], s.batch, s.p95_context, e),
    }
    contexts = sorted({2**k for k in range(10, 21) if 2**k <= max(arch.max_context or 0, s.p95_context)})
    grid = [
        {"batch": b, "context": c, "ratio": pressure(arch, w["bytes"], b, c, e)["ratio"]}
        for b in BATCHES
        for c in contexts
    ]
    measured = measured_variants([Path(r) for r in s.runs])
    rows = capacity_rows(arch, s, free, measured)
    link = s.link_gbps or LINKS[s.link]
    off = offload(points["p95"]["kv_bytes"], w["bytes"], s.hbm_gbps, link)
    off["link"] = "plan.link_gbps" if s.link_gbps else s.link
    return {
        "model": arch.name,
        "config_source": source.where,
        "settings": s.__dict__,
        "architecture": _architecture(arch),
        "kv_bytes_per_token": {
            fmt: arch.layers * arch.per_layer_elements * format_bytes(arch, fmt, s.kv_dtype)
            for fmt in ("bf16", "fp8", "int4")
        },
        "kv_bytes_per_sequence": {
            "context": s.context,
            "full": kv_bytes_per_sequence(arch, s.context, e, window=False),
            "as_declared": kv_bytes_per_sequence(arch, s.context, e),
        },
        "weights": w,
        "free_bytes": free,
        "pressure": {
            "points": points,
            "grid": grid,
            "crossover": {b: crossover_context(arch, w["bytes"], b, e) for b in BATCHES},
        },
        "capacity": rows,
        "offload": off,
        "guide": guide(arch, s, w["bytes"], free, points, rows, measured),
    }


def _architecture(arch: Arch) -> dict[str, Any]:
    """What the plan records of the model's attention: MHA, GQA-k, MQA or MLA, sliding layers, max context."""
    if arch.mla:
        kind = "MLA"
    elif arch.kv_heads == arch.heads:
        kind = "MHA"
    else:
        kind = "MQA" if arch.kv_heads == 1 else f"GQA-{arch.kv_heads}"
    return {
        "layers": arch.layers,
        "heads": arch.heads,
        "kv_heads": arch.kv_heads,
        "head_dim": arch.head_dim,
        "attention": kind,
        "mla": list(arch.mla) if arch.mla else None,
        "sliding_window": arch.window,
        "sliding_layers": arch.sliding_layers,
        "max_context": arch.max_context,
    }
