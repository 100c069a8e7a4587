"""Tasks: each produces samples (context, question, answers) and scores a prediction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from evalkit import scoring
from evalkit.errors import ConfigError
from evalkit.fields import check_fields
from evalkit.scoring import contains_all, contains_any  # noqa: F401 - the tasks' scorers, named here too


@dataclass
class Sample:
    id: str
    context: str  # the part of the prompt a policy compresses
    question: str  # appended after compression
    answers: list[str]
    cell: dict[str, Any]  # breakdown keys for the report: context_length, depth, haystack, ...
    evidence: list[str] = field(default_factory=list)  # substrings of the context that hold the answer
    answer_prefix: str = ""  # starts the model's answer, e.g. "The special magic number is"
    continuation: str = ""  # teacher-forced after the context instead of a question (fidelity)


@dataclass(kw_only=True)
class Task:
    """Base task. Subclasses generate samples; scoring defaults to answer containment."""

    name: str
    seed: int = 0
    max_new_tokens: int = 16
    # What a task class is, not a setting a config may switch on (a needle run teacher-forced would be judged on its
    # agreement with the baseline, which scores 1 by construction, as if it were retrieval accuracy)
    teacher_forced: ClassVar[bool] = False  # True: score a continuation's logits against the baseline's, not answers
    external: ClassVar[bool] = False  # True: another harness produces the rows (lm-eval), not the sample loop

    def samples(self, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        raise NotImplementedError

    def lengths(self) -> list[int]:
        """Context lengths in tokens that the run will use (for validation before the model loads)."""
        raise NotImplementedError

    def validate(self) -> None:
        """Raise ConfigError for a configuration that cannot produce samples. This base checks every field against
        its annotation (a bool is true or false, an int a whole number, ...) and the answer length; tasks extend it,
        calling it first."""
        check_fields(self, "task")
        least = 0 if self.teacher_forced else 1
        if self.max_new_tokens < least:
            raise ConfigError(f"task.max_new_tokens={self.max_new_tokens}: the answer needs at least {least} token(s)")

    def score(self, prediction: str, sample: Sample) -> float:
        return scoring.score(self.scorer_spec(sample), prediction, sample.answers)

    def scorer_spec(self, sample: Sample) -> dict[str, Any]:
        """The spec of the scorer of this sample's predictions (evalkit.scoring.spec), recorded in its rows so that
        the gate can score them again."""
        return scoring.spec("contains_all")

    def answer_tokens(self, sample: Sample) -> int:
        """The most tokens to generate for this sample (a dataset may set it per row, task=hf)."""
        return self.max_new_tokens

    def row_fields(self, sample: Sample) -> dict[str, Any]:
        """Fields added to each of this sample's rows in samples.jsonl (task=hf: where its row came from, how its
        context was truncated)."""
        return {}
