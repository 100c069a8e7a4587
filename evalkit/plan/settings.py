"""The plan node (conf/plan.yaml), checked: one ConfigError naming the key and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evalkit.arch import ELEMENT
from evalkit.errors import ConfigError
from evalkit.fields import number
from evalkit.plan.pressure import LINKS


@dataclass
class Settings:
    gpu_gib: float
    utilization: float
    batch: int
    context: int
    p95_context: int
    weight_dtype: str
    weights_gib: float | None
    kv_dtype: str
    budgets: list[float]
    prefix_hit_rate: float
    link: str
    link_gbps: float | None
    hbm_gbps: float
    runs: list[str]
    out: str | None


# The largest value each number may take: beyond any deployment, and where the planner's arithmetic (bytes of a
# batch of contexts, sequences that fit) would leave floats
LARGEST = {"gpu_gib": 1e6, "weights_gib": 1e6, "hbm_gbps": 1e6, "link_gbps": 1e6, "batch": 1e6, "context": 1e8,
           "p95_context": 1e8}  # fmt: skip
EXAMPLE = {"gpu_gib": 80, "weights_gib": 16, "hbm_gbps": 3350, "link_gbps": 64, "batch": 32, "context": 8192,
           "p95_context": 32768}  # fmt: skip


def settings(d: dict[str, Any]) -> Settings:
    """The plan node as plain values (conf/plan.yaml's `plan`, composed by evalkit.cli.plan), checked: one
    ConfigError naming the key and the fix."""
    unknown = set(d) - set(Settings.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown plan keys {sorted(unknown)}; valid: {sorted(Settings.__dataclass_fields__)}")
    s = Settings(**d)

    def positive(key: str, whole: bool = False) -> None:
        v, most = getattr(s, key), LARGEST[key]
        if not number(v, (int,) if whole else (int, float)) or not 0 < v <= most:
            shown = repr(v) if len(repr(v)) <= 40 else f"{repr(v)[:37]}..."
            what = "whole number" if whole else "number"
            raise ConfigError(f"plan.{key}={shown}: give a {what} in (0, {most:g}], e.g. plan.{key}={EXAMPLE[key]}")

    for key in ("gpu_gib", "hbm_gbps"):
        positive(key)
    for key in ("batch", "context", "p95_context"):
        positive(key, whole=True)
    if not (isinstance(s.utilization, (int, float)) and not isinstance(s.utilization, bool) and 0 < s.utilization <= 1):
        raise ConfigError(f"plan.utilization={s.utilization!r}: give a share in (0, 1], e.g. 0.9")
    if not (isinstance(s.prefix_hit_rate, (int, float)) and not isinstance(s.prefix_hit_rate, bool)
            and 0 <= s.prefix_hit_rate < 1):  # fmt: skip
        raise ConfigError(f"plan.prefix_hit_rate={s.prefix_hit_rate!r}: give a share in [0, 1), e.g. 0.5")
    if not isinstance(s.weight_dtype, str) or s.weight_dtype not in ELEMENT:
        raise ConfigError(f"plan.weight_dtype={s.weight_dtype!r} is not one of {list(ELEMENT)}")
    if not isinstance(s.kv_dtype, str) or s.kv_dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"plan.kv_dtype={s.kv_dtype!r} is not one of bfloat16, float16, float32")
    if not isinstance(s.budgets, list) or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < 1 for b in s.budgets
    ):
        raise ConfigError(f"plan.budgets={s.budgets!r}: give a list of shares in (0, 1), e.g. [0.5,0.25]")
    if not isinstance(s.link, str) or s.link not in LINKS:
        raise ConfigError(f"plan.link={s.link!r} is not one of {list(LINKS)} (or give plan.link_gbps=GB/s)")
    if s.link_gbps is not None:
        positive("link_gbps")
    if s.weights_gib is not None:
        positive("weights_gib")
    if not isinstance(s.runs, list) or not all(isinstance(r, str) and r for r in s.runs):
        raise ConfigError(f"plan.runs={s.runs!r}: give a list of run folders, e.g. plan.runs=[results/a,results/b]")
    if s.out is not None and not (isinstance(s.out, str) and s.out):
        raise ConfigError(f"plan.out={s.out!r}: give a folder, e.g. plan.out=results/plan, or null for the default")
    if s.p95_context < s.context:
        raise ConfigError(
            f"plan.p95_context={s.p95_context} is below plan.context={s.context} (the median): the 95th percentile of "
            f"context lengths is at least the median; give e.g. plan.p95_context={2 * s.context}"
        )
    return s
