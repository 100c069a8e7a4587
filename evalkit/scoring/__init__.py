"""The scorers of evalkit's tasks, without torch: a task scores its predictions here, and the gate and resume score a
row's prediction again with the same function, so that a score a row claims is never believed.

A scorer is named by a spec that every generated row carries (`scorer`): {"name": one of SCORERS, "subtask": the
dataset's task where the scorer has several (LongBench's lcc, RULER's qa_1), "extra": what the row's scorer needs
beyond its answers (LongBench's class names)}. Teacher-forced rows (task=fidelity) are scored from logits and
lm-eval's rows by lm-eval's own task code: neither carries a spec, and the run's config says which they are
(`expected`).
"""

from __future__ import annotations

import math
from importlib import import_module
from typing import Any

SCORERS = ("contains_all", "contains_any", "ruler", "longbench", "infinitebench", "loogle", "zero_scrolls", "needle")
MODULES = {"needle": "needle_in_haystack"}  # the hf scorer `needle` is kvpress's needle-in-a-haystack ROUGE-L
TOLERANCE = 1e-9  # the same function on the same text: only a float's last bits may differ (JSON round trip)


def contains_any(prediction: str, answers: list[str]) -> float:
    """1.0 if any reference answer occurs in the prediction (case-insensitive), else 0.0 (RULER string_match_part)."""
    text = prediction.lower()
    return float(any(a.lower() in text for a in answers))


def contains_all(prediction: str, answers: list[str]) -> float:
    """The share of reference answers that occur in the prediction, case-insensitive (RULER string_match_all):
    1.0 only when every one is there."""
    text = prediction.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def module(name: str):
    """The module of a dataset scorer (ruler, longbench, ...): its `score` and `check`. Imported by name, only when
    a task or a row uses it (rouge-score and rapidfuzz load then)."""
    return import_module(f"evalkit.scoring.{MODULES.get(name, name)}")


def spec(name: str, subtask: str = "", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a row records of its scorer (see the module's docstring)."""
    return {"name": name, "subtask": subtask, "extra": dict(extra or {})}


def score(scorer: dict[str, Any], prediction: str, answers: list[str]) -> float:
    """The score of `prediction` against `answers` under a scorer spec (spec)."""
    name = scorer["name"]
    if name == "contains_all":
        return contains_all(prediction, answers)
    if name == "contains_any":
        return contains_any(prediction, answers)
    return float(module(name).score(prediction, answers, scorer.get("subtask") or "", scorer.get("extra") or {}))


# Tasks whose rows no scorer here scores, by their config's _target_ (the gate cannot import the tasks)
TEACHER_FORCED = ("evalkit.tasks.fidelity.FidelityTask",)  # scored from logits: score = top-1 agreement
EXTERNAL = ("evalkit.tasks.lmeval.LmEvalTask",)  # scored by lm-eval's own task code


def teacher_forced(task: dict[str, Any]) -> bool:
    """Whether a run's task config (run.json config.task) is a teacher-forced task: by its class alone, never by a
    flag in the file (a flag would turn the re-scoring of every row off)."""
    return task.get("_target_") in TEACHER_FORCED


def external(task: dict[str, Any]) -> bool:
    """Whether another harness scored the run's rows (lm-eval): by its task's class alone, as teacher_forced."""
    return task.get("_target_") in EXTERNAL


def expected(task: dict[str, Any]) -> str | None:
    """The scorer a run's task config implies (run.json config.task), or None where its rows carry no spec: scored
    from logits (teacher-forced) or by another harness (external, lm-eval)."""
    if teacher_forced(task) or external(task):
        return None
    if "scorer" in task:
        return str(task["scorer"])
    if "scoring" in task:
        return f"contains_{task['scoring']}"
    return "contains_all"


def problem(row: dict[str, Any], want: str | None) -> str | None:
    """Why a row's score is not what its scorer gives its prediction (`want`: the scorer its run's config implies,
    expected); None when it is, or when the run's rows carry no spec."""
    if want is None:
        return None
    scorer, prediction, answers = row.get("scorer"), row.get("prediction"), row.get("answers")
    if not isinstance(scorer, dict) or scorer.get("name") not in SCORERS:
        return f"has scorer={scorer!r}: the gate scores every prediction again and needs the scorer it was scored by"
    if scorer["name"] != want:
        return f"has scorer {scorer['name']!r} but its run's task is scored by {want!r} (run.json config.task)"
    if not isinstance(prediction, str):
        return f"has prediction={_short(prediction)}, not a string: the gate scores every prediction again"
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        return f"has answers={_short(answers)}, not a list of strings: the gate scores every prediction against them"
    if not isinstance(scorer.get("subtask", ""), str) or not isinstance(scorer.get("extra") or {}, dict):
        return f"has scorer={_short(scorer)}: subtask must be a string and extra an object"
    try:
        derived = score(scorer, prediction, answers)
    except Exception as err:  # noqa: BLE001 - a scorer given what no task wrote (an edited spec): refused, not a crash
        return f"has a scorer spec its scorer cannot use ({type(err).__name__}: {err})"
    if not math.isclose(row["score"], derived, abs_tol=TOLERANCE):
        return f"score={row['score']!r} but its prediction {_short(prediction)} scores {derived:g} ({scorer['name']})"
    return None


def _short(value: Any, k: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= k else f"{text[:k]}... ({len(text)} characters)"
