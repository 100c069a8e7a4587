"""Fidelity without labels: teacher-forced continuations after a compressed context.

Contexts are generated prose of `context_lengths` tokens followed by `continuation_tokens` more of the same
prose, or, with `path`, the contexts of a JSONL file (see evalkit.tasks.jsonl) whose last `continuation_tokens`
tokens become the continuation. Scores are the top-1 agreement with the full cache; KL and the perplexity ratio
go in every row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

from transformers import PreTrainedTokenizerBase

from evalkit.errors import ConfigError
from evalkit.tasks import Sample, Task
from evalkit.tasks.haystack import prose
from evalkit.tasks.jsonl import read_jsonl
from evalkit.tasks.needle import build_context


@dataclass(kw_only=True)
class FidelityTask(Task):
    name: str = "fidelity"
    teacher_forced: ClassVar[bool] = True
    context_lengths: list[int] = field(default_factory=lambda: [1024])
    continuation_tokens: int = 64
    samples_per_cell: int = 2
    path: str = ""  # a JSONL file whose contexts to use instead of generated prose

    def lengths(self) -> list[int]:
        return [] if self.path else list(self.context_lengths)

    def validate(self) -> None:
        super().validate()
        if self.continuation_tokens < 2:
            raise ConfigError(f"task.continuation_tokens={self.continuation_tokens}: need at least 2")
        if self.path:
            read_jsonl(self.path)
        elif not self.context_lengths or self.samples_per_cell < 1:
            raise ConfigError("task.context_lengths and task.samples_per_cell make an empty grid")
        elif any(n < 16 for n in self.context_lengths):
            raise ConfigError(f"task.context_lengths={self.context_lengths}: use at least 16 tokens")

    def samples(self, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        if self.path:
            return [
                self._split(tokenizer, row.id, row.context, {**row.cell, "source": "jsonl"})
                for row in read_jsonl(self.path)
            ]
        out = []
        for length in self.context_lengths:
            for i in range(self.samples_per_cell):
                rng = random.Random(f"{self.seed}/fidelity/{length}/{i}")
                text = build_context(tokenizer, prose(rng), [], length + self.continuation_tokens)
                out.append(
                    self._split(tokenizer, f"L{length}-{i}", text, {"context_length": length, "source": "prose"})
                )
        return out

    def _split(self, tokenizer, sid: str, text: str, cell: dict) -> Sample:
        """The text's last `continuation_tokens` tokens become the continuation (split at a token boundary)."""
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(offsets) <= self.continuation_tokens:
            raise ConfigError(
                f"sample {sid!r}: {len(offsets)} tokens, too few for a {self.continuation_tokens}-token "
                "continuation; lower task.continuation_tokens"
            )
        cut = offsets[len(offsets) - self.continuation_tokens][0]
        return Sample(sid, text[:cut], "", [], cell, continuation=text[cut:])

    def score(self, prediction: str, sample: Sample) -> float:
        raise NotImplementedError("fidelity rows are scored from their logits against the baseline's, not by the task")
