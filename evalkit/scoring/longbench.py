"""LongBench's per-task metrics (Bai et al., 2024, "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding", ACL 2024; metrics.py and eval.py of THUDM/LongBench, as kvpress's evaluation applies them to
`Xnhyacinth/LongBench`):

    QA F1 (SQuAD-normalised unigram F1)   narrativeqa qasper multifieldqa_en hotpotqa 2wikimqa musique triviaqa
    ROUGE-L F1                            gov_report qmsum multi_news samsum
    classification                        trec (the share of the matched class names that is the answer)
    retrieval                             passage_retrieval_en ("Paragraph N": the share of the numbers said that are N)
    count                                 passage_count (the share of the numbers said that are the count)
    code similarity (edit similarity)     lcc repobench-p (the first line that is not a comment or a fence)

A row scores the best over its references; for trec, triviaqa and samsum only the prediction's first line counts.

Libraries, not re-implementations: ROUGE-L is Google's `rouge-score` (LongBench used the `rouge` package, whose
ROUGE-L F weights recall by P/R and splits sentences: scores differ in the last digits), code similarity is
`rapidfuzz`'s `fuzz.ratio` (the Indel similarity LongBench takes from `fuzzywuzzy`, without its rounding to a whole
percent). The Chinese tasks (multifieldqa_zh, dureader, vcsum, lsht, passage_retrieval_zh) need jieba's word
segmentation and are refused; kvpress's dataset does not include them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import cache

from rapidfuzz import fuzz
from rouge_score import rouge_scorer


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: list[str], reference: list[str]) -> float:
    """Unigram F1 of two token lists (multiset overlap)."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


@cache
def _rouge(kind: str) -> rouge_scorer.RougeScorer:
    return rouge_scorer.RougeScorer([kind])


def rouge(prediction: str, reference: str, kind: str = "rougeL", measure: str = "fmeasure") -> float:
    """ROUGE (rouge-score, no stemming) of a prediction against one reference: `measure` is fmeasure, recall or
    precision."""
    return float(getattr(_rouge(kind).score(reference, prediction)[kind], measure))


def rouge_l(prediction: str, reference: str, **_) -> float:
    return rouge(prediction, reference)


def classification(prediction: str, reference: str, all_classes: list[str] | None = None, **_) -> float:
    """LongBench's classification_score, kept as written (the list is changed while it is iterated, so of two
    adjacent classes contained in the answer only the first is dropped)."""
    matches = [c for c in all_classes or [] if c in prediction]
    for term in matches:
        if term in reference and term != reference:
            matches.remove(term)
    return 1.0 / len(matches) if reference in matches else 0.0


def _share_of_numbers(prediction: str, wanted: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == wanted for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, reference: str, **_) -> float:
    found = re.findall(r"Paragraph (\d+)", reference)
    return _share_of_numbers(prediction, found[0]) if found else 0.0


def count(prediction: str, reference: str, **_) -> float:
    return _share_of_numbers(prediction, str(reference))


def code_similarity(prediction: str, reference: str, **_) -> float:
    line = next((x for x in prediction.lstrip("\n").split("\n") if "`" not in x and "#" not in x and "//" not in x), "")
    return fuzz.ratio(line, reference) / 100


METRICS = {
    "narrativeqa": qa_f1,
    "qasper": qa_f1,
    "multifieldqa_en": qa_f1,
    "hotpotqa": qa_f1,
    "2wikimqa": qa_f1,
    "musique": qa_f1,
    "triviaqa": qa_f1,
    "gov_report": rouge_l,
    "qmsum": rouge_l,
    "multi_news": rouge_l,
    "samsum": rouge_l,
    "trec": classification,
    "passage_retrieval_en": retrieval,
    "passage_count": count,
    "lcc": code_similarity,
    "repobench-p": code_similarity,
}
FIRST_LINE = ("trec", "triviaqa", "samsum")
CHINESE = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")


def _task(subtask: str) -> str:
    return subtask.removesuffix("-e").removesuffix("_e")  # LongBench-E names its tasks qasper_e, ...


def check(subtask: str) -> str | None:
    """Why a task cannot be scored here, or None."""
    name = _task(subtask)
    if name in CHINESE:
        return f"LongBench's Chinese task {name!r} needs jieba's segmentation, which evalkit does not ship"
    if name not in METRICS:
        return f"LongBench has no task {name!r}; its tasks: {', '.join(METRICS)}"
    return None


def score(prediction: str, answers: list[str], subtask: str, extra: dict | None = None) -> float:
    """One row's LongBench score in [0, 1]: the best over its references (LongBench reports the mean times 100)."""
    name = _task(subtask)
    if name in FIRST_LINE:
        prediction = prediction.lstrip().split("\n")[0]
    metric = METRICS[name]
    classes = (extra or {}).get("all_classes")
    return max(metric(prediction.lstrip(), a, all_classes=classes) for a in answers)
