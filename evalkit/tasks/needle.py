"""Needle in a haystack, single or several: needles at controlled depths in a haystack of a controlled length.

Kamradt 2023 ("Needle In A Haystack"); the passkey variant of Mohtashami & Jaggi 2023; the multi-needle variants
follow RULER (Hsieh et al. 2024): `multikey` (the asked needle among distractor needles of the same form),
`multivalue` (several values for one key, all required), `multiquery` (several keys asked at once, all required).
The grid is context length (in tokens of the model's tokenizer) x depth of the first asked needle, with
`samples_per_cell` samples each; other needles go to depths drawn from the sample's seed.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from evalkit import scoring
from evalkit.errors import ConfigError
from evalkit.tasks import Sample, Task
from evalkit.tasks.haystack import HAYSTACKS

NEEDLE = "The special magic number is {value}."
QUESTION = "What is the special magic number mentioned in the text? Answer with the number only."
ANSWER_PREFIX = "The special magic number is"

KEYED_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
KEYED_QUESTION = "What are all the special magic {kind} for {keys} mentioned in the text?"
KEYED_PREFIX = "The special magic {kind} for {keys} mentioned in the text are:"

_ADJECTIVES = [
    "amber",
    "brisk",
    "calm",
    "dusty",
    "eager",
    "fuzzy",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lucky",
    "mellow",
    "noble",
    "orange",
    "plain",
    "quiet",
    "rusty",
    "silver",
    "tidy",
    "vivid",
    "witty",
]
_NOUNS = [
    "anchor",
    "badger",
    "candle",
    "dragon",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "meadow",
    "needle",
    "orchard",
    "pepper",
    "quarry",
    "river",
    "saddle",
    "tunnel",
    "violin",
]
_WORDS = [
    "apricot",
    "blizzard",
    "cathedral",
    "dolphin",
    "ember",
    "fountain",
    "glacier",
    "horizon",
    "ivory",
    "juniper",
    "kaleidoscope",
    "lantern",
    "marble",
    "nebula",
    "obsidian",
    "paprika",
    "quartz",
    "rhubarb",
    "sapphire",
    "thistle",
    "umbrella",
    "velvet",
    "walnut",
    "zeppelin",
]
VALUE_TYPES = ("number", "word", "uuid")
SCORING = ("all", "any")  # RULER string_match_all and string_match_part (evalkit.scoring)


@dataclass(kw_only=True)
class NeedleTask(Task):
    name: str = "needle"
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    samples_per_cell: int = 1
    haystack: str = "noise"
    digits: int = 7
    keys: int = 1  # needles with distinct keys in the haystack (the asked ones plus distractors)
    values_per_key: int = 1  # values given for each key, all required for an asked key
    queries: int = 1  # keys asked at once
    value_type: str = "number"  # number, word or uuid
    scoring: str = "all"  # all: RULER string_match_all (share of references found); any: string_match_part

    def lengths(self) -> list[int]:
        return list(self.context_lengths)

    @property
    def keyed(self) -> bool:
        """Whether needles carry keys (any multi-needle variant) rather than the classic single magic number."""
        return (self.keys, self.values_per_key, self.queries, self.value_type) != (1, 1, 1, "number")

    def validate(self) -> None:
        super().validate()
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
        if self.value_type not in VALUE_TYPES:
            raise ConfigError(f"task.value_type={self.value_type!r} is not one of {list(VALUE_TYPES)}")
        if self.scoring not in SCORING:
            raise ConfigError(f"task.scoring={self.scoring!r} is not one of {list(SCORING)}")
        if not 1 <= self.queries <= self.keys or self.values_per_key < 1:
            raise ConfigError(
                f"task.queries={self.queries}, task.keys={self.keys}, task.values_per_key={self.values_per_key}: "
                "need 1 <= queries <= keys and values_per_key >= 1"
            )
        if self.keys > len(_ADJECTIVES) * len(_NOUNS):
            raise ConfigError(f"task.keys={self.keys}: at most {len(_ADJECTIVES) * len(_NOUNS)} distinct keys exist")
        if not 1 <= self.digits <= 30:
            raise ConfigError(f"task.digits={self.digits}: give a number of digits from 1 to 30, e.g. task.digits=7")

    def scorer_spec(self, sample: Sample) -> dict:
        return scoring.spec(f"contains_{self.scoring}")

    def samples(self, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        out = []
        for length in self.context_lengths:
            for depth in self.depths:
                for i in range(self.samples_per_cell):
                    rng = random.Random(f"{self.seed}/{self.haystack}/{length}/{depth}/{i}")
                    out.append(self._sample(tokenizer, rng, length, depth, i))
        return out

    def _value(self, rng: random.Random) -> str:
        if self.value_type == "uuid":
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if self.value_type == "word":
            return rng.choice(_WORDS)
        return str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))

    def _sample(self, tokenizer, rng: random.Random, length: int, depth: float, i: int) -> Sample:
        cell = {"context_length": length, "depth": depth, "haystack": self.haystack}
        if not self.keyed:
            value = self._value(rng)
            needle = NEEDLE.format(value=value)
            context = build_context(tokenizer, HAYSTACKS[self.haystack](rng), [(needle, depth)], length)
            return Sample(f"L{length}-d{depth:g}-{i}", context, QUESTION, [value], cell, [needle], ANSWER_PREFIX)
        kind = {"number": "numbers", "word": "words", "uuid": "uuids"}[self.value_type]
        keys = rng.sample([f"{a}-{n}" for a in _ADJECTIVES for n in _NOUNS], self.keys)
        values = {k: [self._value(rng) for _ in range(self.values_per_key)] for k in keys}
        asked = keys[: self.queries]
        needles = [(KEYED_NEEDLE.format(kind=kind, key=k, value=v), rng.random()) for k in keys for v in values[k]]
        needles[0] = (needles[0][0], depth)  # the first asked needle sits at the cell's depth
        context = build_context(tokenizer, HAYSTACKS[self.haystack](rng), needles, length)
        joined = ", ".join(asked)
        return Sample(
            id=f"L{length}-d{depth:g}-{i}",
            context=context,
            question=KEYED_QUESTION.format(kind=kind, keys=joined),
            answers=[v for k in asked for v in values[k]],
            cell={**cell, "value_type": self.value_type},
            evidence=[text for text, _ in needles if any(f" for {k} is:" in text for k in asked)],
            answer_prefix=KEYED_PREFIX.format(kind=kind, keys=joined),
        )


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def build_context(tokenizer, filler, needles: list[tuple[str, float]], length: int) -> str:
    """Filler sentences around the needles so the whole is at most `length` tokens, each needle at its depth.

    Per-sentence counts place the needles; the joined text is then measured and trimmed, so the result
    never exceeds `length` tokens and falls short of it by at most one sentence.
    """
    budget = length - sum(count_tokens(tokenizer, n) for n, _ in needles)
    sentences, total = [], 0
    while total < budget:
        s = next(filler)
        sentences.append(s)
        total += count_tokens(tokenizer, " " + s)
    cuts, acc, i = [], 0, 0
    for _, depth in sorted(needles, key=lambda nd: nd[1]):
        while i < len(sentences) and acc < depth * budget:
            acc += count_tokens(tokenizer, " " + sentences[i])
            i += 1
        cuts.append(i)
    ordered = [n for n, _ in sorted(needles, key=lambda nd: nd[1])]
    pieces = [sentences[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(sentences)], strict=True)]

    def join() -> str:
        out = list(pieces[0])
        for needle, piece in zip(ordered, pieces[1:], strict=True):
            out += [needle, *piece]
        return " ".join(out)

    while count_tokens(tokenizer, join()) > length:  # trim at the ends first, so the needles keep their depths
        if pieces[-1]:
            pieces[-1].pop()
        elif pieces[0]:
            pieces[0].pop(0)
        else:
            next(p for p in pieces if p).pop()
    return join()
