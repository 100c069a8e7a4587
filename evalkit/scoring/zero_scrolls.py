"""ZeroSCROLLS' metrics (Shaham et al., 2023, "ZeroSCROLLS: A Zero-Shot Benchmark for Long Text Understanding",
Findings of EMNLP 2023):

    gov_report, summ_screen_fd, qmsum, squality   geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L F1 (rouge-score)
    qasper, narrative_qa, musique                 QA F1 (SQuAD-normalised unigram F1), best over the references
    quality                                       exact match after SQuAD normalisation (the option chosen)

ZeroSCROLLS keeps its test answers private: kvpress's `simonjegou/zero_scrolls` has an empty `answer` column (its
scorer returns nothing; predictions go to the leaderboard). Rows without an answer are refused before the model
loads; give the validation split with answers (task.columns.answers=...). space_digest (exponential similarity)
and book_sum_sort (concordance index) are not scored here and are refused.
"""

from __future__ import annotations

import math

from evalkit.scoring.longbench import normalize_answer, qa_f1, rouge

SUMMARIES = ("gov_report", "summ_screen_fd", "qmsum", "squality")
QA = ("qasper", "narrative_qa", "musique")


def rouge_geometric(prediction: str, reference: str) -> float:
    parts = [rouge(prediction, reference, kind) for kind in ("rouge1", "rouge2", "rougeL")]
    return math.prod(parts) ** (1 / 3)


def check(subtask: str) -> str | None:
    if subtask in SUMMARIES + QA + ("quality",):
        return None
    return f"ZeroSCROLLS task {subtask!r} is not scored by evalkit (scored: {', '.join(SUMMARIES + QA + ('quality',))})"


def score(prediction: str, answers: list[str], subtask: str, extra: dict | None = None) -> float:
    """One row's ZeroSCROLLS score in [0, 1], the best over its references."""
    if subtask in SUMMARIES:
        return max(rouge_geometric(prediction, a) for a in answers)
    if subtask in QA:
        return max(qa_f1(prediction, a) for a in answers)
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))
