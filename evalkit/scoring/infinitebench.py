"""InfiniteBench's per-task scorers (Zhang et al., 2024, "∞Bench: Extending Long Context Evaluation Beyond 100K
Tokens", ACL 2024; src/compute_scores.py of OpenBMB/InfiniteBench, as kvpress's evaluation applies them to
`MaxJeblick/InfiniteBench`):

    passkey, number_string        the first run of digits in the prediction equals the answer
    kv_retrieval                  the answer is one of the prediction's words (split at \\n : " ' . , ? ! { })
    math_find                     the first number in the prediction equals the answer
    math_calc                     the share of the leading values that are right, up to the first wrong one
    code_run                      the prediction's last word is the answer (an integer)
    code_debug, longbook_choice_eng   the option letter chosen (the last standalone letter, else an answer prefix)
    longdialogue_qa_eng           an answer name occurs in the prediction (case-insensitive)
    longbook_qa_eng               QA F1 (SQuAD-normalised unigram F1), best over the references
    longbook_qa_chn               character F1, best over the references
    longbook_sum_eng              ROUGE-Lsum F1 (rouge-score), as InfiniteBench's own scorer

Departures, where kvpress's dataset differs from the original files: its answers are strings, so math_find compares
numbers parsed from both sides (kvpress raises a TypeError on a string), and code_debug's answer is the option
letter alone (kvpress indexes a [function name, letter] pair it no longer has), scored as a multiple choice.
"""

from __future__ import annotations

import re
import string

from evalkit.scoring.longbench import normalize_answer, rouge, token_f1

SEPARATORS = ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]


def first_int(prediction: str) -> str:
    return next((x for x in re.split("[^0-9]", prediction) if x), "")


def kv_retrieval(pred: str, answers: list[str]) -> bool:
    for c in SEPARATORS:
        pred = pred.replace(c, " ")
    return answers[0] in pred.split()


def first_number_match(pred: str, answers: list[str]) -> bool:
    return answers[0] == first_int(pred)


def math_find(pred: str, answers: list[str]) -> bool:
    label = answers[0].strip()
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None:
        return False
    if re.fullmatch(r"-?\d+", label):
        return int(found.group(0)) == int(label)
    return float(found.group(0)) == float(label)


def math_calc(pred: str, answers: list[str]) -> float:
    numbers = [int(x) for x in re.split("[^0-9]", pred) if x]
    right = 0
    for want, got in zip(answers, numbers, strict=False):  # up to the first wrong value
        if int(want) != got:
            break
        right += 1
    return right / len(answers)


def code_run(pred: str, answers: list[str]) -> bool:
    pred = pred.strip()
    for c in ["\n", ".", "`", "'", '"', ":"]:
        pred = pred.replace(c, " ")
    words = pred.split()
    try:
        return bool(words) and int(words[-1]) == int(answers[0])
    except ValueError:
        return False


def choice(pred: str, answers: list[str], letters: str = "ABCD") -> bool:
    """InfiniteBench's longbook_choice_eng: the last standalone option letter, else the first character, else what
    follows an answer prefix, else the first word that is a letter."""
    pred = pred.strip()
    found = re.search(rf"\b[{letters[0]}-{letters[-1]}]\b(?!.*\b[{letters[0]}-{letters[-1]}]\b)", pred)
    if found and found.group(0) in answers:
        return True
    if pred == "":
        return False
    if pred[0] in letters:
        return pred[0] in answers
    if pred in answers:
        return True
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "answer:", "answer is", "option is"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        after = pred[idx + len(prefix) + 1 :]
        return len(pred) >= idx + len(prefix) + 1 and any(after.startswith(s) for s in answers)
    return next((w in answers for w in pred.split() if w in letters), False)


def dialogue(pred: str, answers: list[str]) -> bool:
    return any(a.upper() in pred.strip().upper() for a in answers)


def qa_eng(pred: str, answers: list[str]) -> float:
    return max(token_f1(normalize_answer(pred).split(), normalize_answer(a).split()) for a in answers)


ZH_PUNCTUATION = set(string.punctuation) | set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def _zh(text: str) -> list[str]:
    """InfiniteBench's Chinese normalisation, one character a token: lower case, no spaces, no punctuation."""
    return [ch for ch in "".join(text.lower().split()) if ch not in ZH_PUNCTUATION]


def qa_chn(pred: str, answers: list[str]) -> float:
    return max(token_f1(_zh(pred), _zh(a)) for a in answers)


def summary(pred: str, answers: list[str]) -> float:
    return max(rouge(pred, a, "rougeLsum") for a in answers)


METRICS = {
    "passkey": first_number_match,
    "number_string": first_number_match,
    "kv_retrieval": kv_retrieval,
    "kv_retrieval_prefix": kv_retrieval,
    "kv_retrieval_both": kv_retrieval,
    "math_find": math_find,
    "math_calc": math_calc,
    "code_run": code_run,
    "code_debug": lambda p, a: choice(p, a, "ABCDEFGHIJ"),
    "longbook_choice_eng": choice,
    "longdialogue_qa_eng": dialogue,
    "longbook_qa_eng": qa_eng,
    "longbook_qa_chn": qa_chn,
    "longbook_sum_eng": summary,
}


def check(subtask: str) -> str | None:
    return None if subtask in METRICS else f"InfiniteBench has no task {subtask!r}; its tasks: {', '.join(METRICS)}"


def score(prediction: str, answers: list[str], subtask: str, extra: dict | None = None) -> float:
    """One row's InfiniteBench score in [0, 1]."""
    return float(METRICS[subtask](prediction, answers))
