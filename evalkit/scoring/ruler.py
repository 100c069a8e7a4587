"""RULER's scorers (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv:2404.06654), as kvpress's evaluation applies them to `simonjegou/ruler` (evaluation/benchmarks/ruler):

- `string_match_part` for the QA tasks (`qa_1`, `qa_2`): 1 if any reference occurs in the prediction;
- `string_match_all` for every other task (niah_*, vt, cwe, fwe): the share of the references that occur in it.

Both are case-insensitive containment, after the prediction's control characters (\\x00-\\x1f) are removed.
"""

from __future__ import annotations

import re

from evalkit.scoring import contains_all, contains_any

CONTROL = re.compile(r"[\x00-\x1f]")


def score(prediction: str, answers: list[str], subtask: str, extra: dict | None = None) -> float:
    """One row's RULER score in [0, 1] (kvpress reports the mean times 100)."""
    prediction = CONTROL.sub("", prediction.strip()).strip()
    metric = contains_any if subtask.split("_")[0] == "qa" else contains_all
    return metric(prediction, answers)


def check(subtask: str) -> str | None:
    """None: every RULER task name is scored (the category before the first '_' chooses all or part)."""
    return None
