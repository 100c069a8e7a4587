"""LooGLE's automatic metrics (Li et al., 2024, "LooGLE: Can Long-Context Language Models Understand Long
Contexts?", ACL 2024; Evaluation/automatic_metrics.py of bigai-nlco/LooGLE, as kvpress's evaluation applies them to
`simonjegou/loogle`):

- shortdep_qa, longdep_qa, longdep_summarization: ROUGE-L **recall** of the reference (LooGLE's and kvpress's
  `get_rouge_score(..., metric="r")`), here from Google's `rouge-score` (they use the `rouge` package, whose ROUGE-L
  is summary-level: the last digits may differ). The papers also report BLEU, METEOR and BERTScore; METEOR needs
  WordNet and BERTScore a model from the Hub, neither available offline, so the per-row score is ROUGE-L recall.
- shortdep_cloze: exact match, the share of the masks (`<mask-0>`, ...) whose entity the prediction gives exactly;
  the prediction is read as a Python/JSON dict literal (ast.literal_eval, never eval); one that is not scores 0.
"""

from __future__ import annotations

import ast
import json

from evalkit.scoring.longbench import rouge

TASKS = ("shortdep_qa", "longdep_qa", "longdep_summarization", "shortdep_cloze")


def _as_dict(text: str) -> dict | None:
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return None


def cloze_exact(prediction: str, reference: str) -> float:
    """The share of the reference's masks the prediction fills exactly (LooGLE's get_exact_match)."""
    ref, hyp = _as_dict(reference), _as_dict(prediction)
    if not ref:
        return 0.0
    if hyp is None:
        return 0.0
    return sum(hyp.get(k) == v for k, v in ref.items()) / len(ref)


def check(subtask: str) -> str | None:
    return None if subtask in TASKS else f"LooGLE has no task {subtask!r}; its tasks: {', '.join(TASKS)}"


def score(prediction: str, answers: list[str], subtask: str, extra: dict | None = None) -> float:
    """One row's LooGLE score in [0, 1], the best over its references."""
    if subtask == "shortdep_cloze":
        return max(cloze_exact(prediction, a) for a in answers)
    return max(rouge(prediction, a, "rougeL", "recall") for a in answers)
