"""The gate's thresholds (conf/gate/*.yaml, read as plain values by evalkit.config.gatefile): typed, ranged, and
refused when no check is left that could show a variant keeps the baseline's accuracy. `Thresholds()` holds
conf/gate/default.yaml's values (tests/test_config.py checks they agree)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from evalkit.errors import ConfigError
from evalkit.fields import number
from evalkit.stats import MULTIPLICITY

GRADED_FLIP_DELTA = 0.1  # the default gate.graded_flip_delta: a graded score must fall by more than this to count


@dataclass
class Thresholds:
    """Conf/gate/*.yaml. None switches a check off."""

    max_drop: float | None = 0.05  # non-inferiority margin on the accuracy drop, shown by its upper bound
    confidence: float = 0.95  # one-sided, of every bound and test
    multiplicity: str = "holm"  # holm, bonferroni or none: across variants, and across cells
    max_flip_rate: float | None = 0.10  # lost samples / samples, shown below it for a PASS
    min_cell_accuracy: float | None = 0.5  # per cell, where the baseline reaches it: a FAIL when shown below it
    min_baseline_accuracy: float | None = 0.5  # below it overall: cannot judge; cells below it are not judged
    max_mean_kl: float | None = 0.1  # nats, fidelity rows: the mean of each row's KL capped at 30x this, shown below it
    max_kl_tail_share: float | None = 0.01  # documents' share of KL rows above the cap, shown below it for a PASS
    min_samples: int | None = None  # contexts; None: the fewest a lossless PASS needs (evalkit.gate.decide.min_samples)
    graded_flip_delta: float = GRADED_FLIP_DELTA  # a graded score counts as lost when it falls by more than this
    min_compression: float = 0.99  # a compressing variant must hold less than this share of the baseline's bytes
    capacity: dict[str, float] = field(default_factory=lambda: {"gpu_gib": 80, "context": 32768})  # report only
    allow_partial: bool = False  # judge an unfinished run (fewer rows than its run.json's samples) as it is


def non_default(t: Thresholds) -> list[str]:
    """The thresholds that differ from the defaults (conf/gate/default.yaml), each `name=value (default d)`: a verdict
    states them beside its status, since a PASS at a loosened margin is not the default's PASS. The capacity figures
    are the report's only."""
    default = asdict(Thresholds())
    return [f"{k}={v!r} (default {default[k]!r})" for k, v in asdict(t).items() if k != "capacity" and v != default[k]]


# Each threshold: the types it takes, its range as (low, high, low included, high included), and an example. None
# (null in YAML) switches a check off where the field allows it (Thresholds).
# A margin of 0 can never be shown held (no bound lies below 0), one of 1 always is: both are refused. min_samples
# stops at 1e9 contexts, where the planner's arithmetic would leave floats.
RANGES: dict[str, tuple[tuple[type, ...], tuple[float, float, bool, bool], str]] = {
    "max_drop": ((int, float), (0, 1, False, False), "0.05"),
    "confidence": ((float,), (0.5, 1, False, False), "0.95"),
    "max_flip_rate": ((int, float), (0, 1, True, True), "0.10"),
    "min_cell_accuracy": ((int, float), (0, 1, True, True), "0.5"),
    "min_baseline_accuracy": ((int, float), (0, 1, True, True), "0.5"),
    "max_mean_kl": ((int, float), (0, math.inf, True, False), "0.1"),
    "max_kl_tail_share": ((int, float), (0, 1, False, False), "0.01"),  # 0 is never shown held, 1 always
    "min_samples": ((int,), (1, 1e9, True, True), "74"),
    "min_compression": ((int, float), (0, 1, False, True), "0.99"),
    "graded_flip_delta": ((int, float), (0, 1, True, False), "0.1"),  # a graded score falling by more is lost
}


# The capacity line's largest accelerator (GiB) and context (tokens): beyond them its arithmetic leaves floats
CAPACITY_MAX = {"gpu_gib": 1e6, "context": 1e9}


def _short(value: Any, width: int = 60) -> str:
    """A value as the user wrote it, cut to `width` characters (a 401-digit number named in full helps no one)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."


NULLABLE = {
    "max_drop", "max_flip_rate", "min_cell_accuracy", "min_baseline_accuracy", "max_mean_kl", "max_kl_tail_share",
    "min_samples",
}  # fmt: skip


def _in_range(value: float, lo: float, hi: float, lo_in: bool, hi_in: bool) -> bool:
    return (lo <= value if lo_in else lo < value) and (value <= hi if hi_in else value < hi)


def _interval(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    return f"{'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"


def check_threshold(key: str, value: Any) -> None:
    """ConfigError unless `value` has the type and lies in the range `key` takes (RANGES)."""
    kinds, bounds, example = RANGES[key]
    if value is None and key in NULLABLE:
        return
    off = ", or null to switch the check off" if key in NULLABLE else ""
    if not number(value, kinds) or not _in_range(value, *bounds):
        what = "a whole number" if kinds == (int,) else "a number"
        raise ConfigError(f"gate.{key}={_short(value)}: give {what} in {_interval(*bounds)}, e.g. {example}{off}")


def thresholds(values: Any, where: str) -> Thresholds:
    """Thresholds from a gate config as plain values (conf/gate/*.yaml, or the run's `gate` node, resolved); `where`
    names it in errors. Every threshold is typed and ranged (RANGES); a gate left with no accuracy check is refused."""
    if not isinstance(values, dict):
        kind = "a list" if isinstance(values, list) else type(values).__name__
        raise ConfigError(f"gate {where} is {kind}, not a mapping of thresholds (max_drop: 0.05, ...); fix its YAML")
    cfg = {k: v for k, v in values.items() if k != "name"}
    unknown = set(cfg) - set(Thresholds.__dataclass_fields__)
    if unknown:  # YAML reads a key `1:` as a number: named as written, never sorted against the names
        names = sorted(map(repr, unknown))
        raise ConfigError(f"gate {where}: unknown thresholds {', '.join(names)}; valid: {', '.join(RANGES)}, ...")
    t = Thresholds(**cfg)
    for key in RANGES:
        check_threshold(key, getattr(t, key))
    if not isinstance(t.allow_partial, bool):
        raise ConfigError(f"gate.allow_partial={_short(t.allow_partial)}: give true or false, e.g. false")
    if not isinstance(t.multiplicity, str) or t.multiplicity not in MULTIPLICITY:
        raise ConfigError(f"gate.multiplicity={_short(t.multiplicity)} is not one of {list(MULTIPLICITY)}")
    cap = t.capacity
    if (
        not isinstance(cap, dict)
        or set(cap) != {"gpu_gib", "context"}
        or not all(number(v) and 0 < v <= CAPACITY_MAX[k] for k, v in cap.items())
    ):
        raise ConfigError(
            f"gate.capacity={_short(cap)}: give {{gpu_gib: 80, context: 32768}}, gpu_gib in (0, "
            f"{CAPACITY_MAX['gpu_gib']:g}] and context in (0, {CAPACITY_MAX['context']:g}]"
        )
    if t.max_drop is None and t.max_flip_rate is None:
        raise ConfigError(
            f"gate {where}: max_drop and max_flip_rate are both null, so no check could show the policy keeps the "
            "baseline's accuracy and any variant would PASS; set at least one, e.g. max_drop: 0.05"
        )
    return t
