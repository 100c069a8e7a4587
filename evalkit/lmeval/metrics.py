"""The per-document metric each lm-eval task's rows are scored by, chosen before any document runs: task.metric, a
default per task (RULER: the document's own length, never lm-eval's -1 placeholder; LongBench's score), or a
refusal."""

from __future__ import annotations

import math
from typing import Any

from evalkit.errors import ConfigError

# A per-document metric for the task families that log several: LongBench's unified `score` (equal to the task's own
# metric, qa_f1_score, rouge_score, ...; the one its groups aggregate).
DEFAULT_METRICS = {"longbench_": "score"}


OWN_LENGTH = None  # choose_metrics' entry for RULER: each document is scored under its own length


def _metric_names(task) -> list[str]:
    return [str(m) for m in task.aggregation()]


def _is_ruler(task, names: list[str]) -> bool:
    """RULER's layout (lm_eval/tasks/ruler/common_utils.process_results): one metric per sequence length, the
    document's own `max_length` holding its score and every other length the placeholder -1."""
    if not names or not all(n.isdigit() for n in names):
        return False
    docs = task.eval_docs
    return len(docs) > 0 and "max_length" in docs[0]


def choose_metrics(
    tasks: dict[str, Any], wanted: str | dict[str, str] | None, key: str = "task.metric"
) -> dict[str, str | None]:
    """The per-document metric each lm-eval task's rows are scored by, chosen before any document runs.

    `wanted` (task.metric): one name for every task, or {task: name}. Unset, a task's metric is its only one;
    RULER's is the document's own length (OWN_LENGTH: never another length's -1 placeholder); LongBench's `score`.
    A task that logs several metrics and has no default is refused (ConfigError), as is a name it does not log;
    errors name the setting as the user gave it (`key`: task.metric, or lm-eval's `--model_args metric`)."""
    if isinstance(wanted, dict):
        unknown = sorted(set(wanted) - set(tasks))
        if unknown:
            raise ConfigError(
                f"{key} names {', '.join(map(repr, unknown))}, not among the tasks run: {', '.join(tasks)}"
            )
    plan: dict[str, str | None] = {}
    for name, task in tasks.items():
        names = _metric_names(task)
        asked = wanted.get(name) if isinstance(wanted, dict) else wanted
        if _is_ruler(task, names):
            lengths = sorted({int(d["max_length"]) for d in task.eval_docs})
            if asked is not None and [str(n) for n in lengths] != [str(asked)]:
                raise ConfigError(
                    f"{key}={asked!r} for {name}: RULER scores each document under its own length "
                    f"({', '.join(map(str, lengths))} here) and logs -1 under every other one; leave {key} "
                    "unset for RULER"
                )
            plan[name] = OWN_LENGTH
        elif asked is not None:
            if asked not in names:
                raise ConfigError(f"{key}={asked!r}: lm-eval task {name!r} logs {', '.join(names)} per document")
            plan[name] = asked
        else:
            default = next((m for p, m in DEFAULT_METRICS.items() if name.startswith(p) and m in names), None)
            if default is None and len(names) != 1:
                raise ConfigError(
                    f"lm-eval task {name!r} logs several per-document metrics ({', '.join(names)}): choose the one "
                    f"flips are scored by with {key}={names[0] if names else 'NAME'} "
                    f"(or {key}.{name}=...; from lm-eval's command line, --model_args metric=...)"
                    if names
                    else f"lm-eval task {name!r} logs no per-document metric; evalkit's records need one"
                )
            plan[name] = default or names[0]
    return plan


def doc_score(task: str, doc: dict, plan: dict[str, str | None]) -> tuple[str, float]:
    """(metric, value) of a logged lm-eval document under the planned metric; a placeholder is never a score."""
    metric = plan[task]
    if metric is OWN_LENGTH:
        metric = str(doc["doc"]["max_length"])
        if doc.get(metric) == -1:
            raise RuntimeError(f"{task}/{doc['doc_id']}: RULER logged its -1 placeholder at the document's own length")
    value = doc.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"lm-eval task {task!r} logged no numeric {metric!r} for document {doc['doc_id']}")
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ConfigError(
            f"lm-eval task {task!r} logged {metric}={value!r} for document {doc['doc_id']}: the gate judges "
            "per-document scores in [0, 1] (right = 1); choose such a metric (task.metric, or --model_args metric=...)"
        )
    return metric, float(value)
