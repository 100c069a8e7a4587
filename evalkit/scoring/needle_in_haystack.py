"""The needle-in-a-haystack score over Paul Graham's essays (kvpress's evaluation/benchmarks/needle_in_haystack):
ROUGE-L recall of the needle in the prediction (rouge-score), the share of the needle's words said in order. kvpress
reports the `rouge` package's scores with the needle passed as the hypothesis: the same quantity is its ROUGE-L "p"
(summary-level LCS there, so the last digits may differ)."""

from __future__ import annotations

from evalkit.scoring.longbench import rouge


def check(subtask: str) -> str | None:
    return None


def score(prediction: str, answers: list[str], subtask: str, extra: dict | None = None) -> float:
    """ROUGE-L recall of the needle (answers[0], the best over the answers) in the prediction."""
    return max(rouge(prediction, a, "rougeL", "recall") for a in answers)
