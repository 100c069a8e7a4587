"""Needle in a haystack: one numeric needle at a controlled depth in a haystack of a controlled token length.

Kamradt 2023 ("Needle In A Haystack"); the passkey variant of Mohtashami & Jaggi 2023. The grid is
context length (in tokens of the model's tokenizer) x insertion depth, with `samples_per_cell` needles each.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from evalkit.errors import ConfigError
from evalkit.tasks import Sample, Task
from evalkit.tasks.haystack import HAYSTACKS

NEEDLE = "The special magic number is {value}."
QUESTION = "What is the special magic number mentioned in the text? Answer with the number only."
ANSWER_PREFIX = "The special magic number is"


@dataclass(kw_only=True)
class NeedleTask(Task):
    name: str = "needle"
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    samples_per_cell: int = 1
    haystack: str = "noise"
    digits: int = 7

    def lengths(self) -> list[int]:
        return list(self.context_lengths)

    def validate(self) -> None:
        if not self.context_lengths or not self.depths or self.samples_per_cell < 1:
            raise ConfigError(
                f"task.context_lengths={list(self.context_lengths)}, task.depths={list(self.depths)} and "
                f"task.samples_per_cell={self.samples_per_cell} make an empty grid; give at least one of each"
            )
        if self.haystack not in HAYSTACKS:
            raise ConfigError(f"task.haystack={self.haystack!r} is not one of {sorted(HAYSTACKS)}")
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad:
            raise ConfigError(f"task.depths={bad} are outside [0, 1] (0 = start of the context, 1 = end)")
        short = [n for n in self.context_lengths if n < 64]
        if short:
            raise ConfigError(f"task.context_lengths={short} are too short for a needle; use at least 64 tokens")

    def samples(self, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        out = []
        for length in self.context_lengths:
            for depth in self.depths:
                for i in range(self.samples_per_cell):
                    rng = random.Random(f"{self.seed}/{self.haystack}/{length}/{depth}/{i}")
                    out.append(self._sample(tokenizer, rng, length, depth, i))
        return out

    def _sample(self, tokenizer, rng: random.Random, length: int, depth: float, i: int) -> Sample:
        value = str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))
        needle = NEEDLE.format(value=value)
        context = build_context(tokenizer, HAYSTACKS[self.haystack](rng), needle, length, depth)
        return Sample(
            id=f"L{length}-d{depth:g}-{i}",
            context=context,
            question=QUESTION,
            answers=[value],
            cell={"context_length": length, "depth": depth, "haystack": self.haystack},
            evidence=[needle],
            answer_prefix=ANSWER_PREFIX,
        )


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def build_context(tokenizer, filler, needle: str, length: int, depth: float) -> str:
    """Filler sentences around `needle` so the whole is at most `length` tokens, the needle at `depth`.

    Per-sentence counts place the needle; the joined text is then measured and trimmed, so the result
    never exceeds `length` tokens and falls short of it by at most one sentence.
    """
    budget = length - count_tokens(tokenizer, needle)
    sentences, total = [], 0
    while total < budget:
        s = next(filler)
        sentences.append(s)
        total += count_tokens(tokenizer, " " + s)
    cut, acc = 0, 0
    while cut < len(sentences) and acc < depth * budget:
        acc += count_tokens(tokenizer, " " + sentences[cut])
        cut += 1
    before, after = sentences[:cut], sentences[cut:]

    def join() -> str:
        return " ".join([*before, needle, *after])

    while count_tokens(tokenizer, join()) > length:
        if after:
            after.pop()
        else:
            before.pop(0)
    return join()
