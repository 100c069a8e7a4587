"""The plan node (conf/plan.yaml), checked: one ConfigError naming the key and the fix."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from evalkit.errors import ConfigError
from evalkit.plan.arch import ELEMENT
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


def settings(d: dict[str, Any]) -> Settings:
    """The plan node as plain values (conf/plan.yaml's `plan`, composed by evalkit.cli.plan), checked: one
    ConfigError naming the key and the fix."""
    unknown = set(d) - set(Settings.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown plan keys {sorted(unknown)}; valid: {sorted(Settings.__dataclass_fields__)}")
    s = Settings(**d)

    def positive(key: str, whole: bool = False) -> None:
        v = getattr(s, key)
        ok = isinstance(v, int) if whole else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or not math.isfinite(v) or v <= 0:  # nan would pass `v <= 0`
            raise ConfigError(f"plan.{key}={v!r}: give a {'whole number' if whole else 'finite number'} > 0")

    for key in ("gpu_gib", "hbm_gbps"):
        positive(key)
    for key in ("batch", "context", "p95_context"):
        positive(key, whole=True)
    if not (isinstance(s.utilization, (int, float)) and 0 < s.utilization <= 1):
        raise ConfigError(f"plan.utilization={s.utilization!r}: give a share in (0, 1], e.g. 0.9")
    if not (isinstance(s.prefix_hit_rate, (int, float)) and 0 <= s.prefix_hit_rate < 1):
        raise ConfigError(f"plan.prefix_hit_rate={s.prefix_hit_rate!r}: give a share in [0, 1), e.g. 0.5")
    if s.weight_dtype not in ELEMENT:
        raise ConfigError(f"plan.weight_dtype={s.weight_dtype!r} is not one of {list(ELEMENT)}")
    if s.kv_dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"plan.kv_dtype={s.kv_dtype!r} is not one of bfloat16, float16, float32")
    if not isinstance(s.budgets, list) or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < 1 for b in s.budgets
    ):
        raise ConfigError(f"plan.budgets={s.budgets!r}: give a list of shares in (0, 1), e.g. [0.5,0.25]")
    if s.link not in LINKS:
        raise ConfigError(f"plan.link={s.link!r} is not one of {list(LINKS)} (or give plan.link_gbps=GB/s)")
    if s.link_gbps is not None:
        positive("link_gbps")
    if s.weights_gib is not None:
        positive("weights_gib")
    if not isinstance(s.runs, list):
        raise ConfigError(f"plan.runs={s.runs!r}: give a list of run folders, e.g. plan.runs=[results/a,results/b]")
    if s.p95_context < s.context:
        raise ConfigError(
            f"plan.p95_context={s.p95_context} is below plan.context={s.context} (the median): the 95th percentile of "
            f"context lengths is at least the median; give e.g. plan.p95_context={2 * s.context}"
        )
    return s
