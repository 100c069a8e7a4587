"""Middle of the document: where the answer sits is the controlled variable.

Liu et al. 2023, "Lost in the Middle: How Language Models Use Long Contexts" (arXiv:2307.03172). Two kinds:
`kv`, key-value retrieval over a JSON object of random UUID pairs, and `fact`, one fact stated in generated prose.
`positions` place the answer from the start (0) to the end (1) of the context; each sample's `split` is `easy`
when the answer is in the final tenth, `hard` when it is in the middle half, `other` elsewhere.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from evalkit.errors import ConfigError
from evalkit.tasks import Sample, Task
from evalkit.tasks.haystack import prose
from evalkit.tasks.needle import build_context, count_tokens

KINDS = ("kv", "fact")
_ROLES = ["cartographer", "florist", "clockmaker", "beekeeper", "glassblower", "ferryman", "astronomer", "tailor"]
_ITEMS = ["silver key", "red notebook", "brass compass", "wool scarf", "clay whistle", "paper kite", "tin lantern"]
_PLACES = ["attic", "wine cellar", "greenhouse", "boathouse", "pantry", "bell tower", "potting shed", "hayloft"]


def split_of(position: float) -> str:
    if position >= 0.9:
        return "easy"
    if 0.25 <= position <= 0.75:
        return "hard"
    return "other"


@dataclass(kw_only=True)
class MiddocTask(Task):
    name: str = "middoc"
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    context_lengths: list[int] = field(default_factory=lambda: [1024])
    positions: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 0.95])
    samples_per_cell: int = 1
    max_new_tokens: int = 40

    def lengths(self) -> list[int]:
        return list(self.context_lengths)

    def validate(self) -> None:
        super().validate()
        if not self.kinds or not self.context_lengths or not self.positions or self.samples_per_cell < 1:
            raise ConfigError(
                "task.kinds, task.context_lengths, task.positions and task.samples_per_cell make an "
                "empty grid; give at least one of each"
            )
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ConfigError(f"task.kinds={bad}: not among {list(KINDS)}")
        if any(not 0.0 <= p <= 1.0 for p in self.positions):
            raise ConfigError(f"task.positions={self.positions} must lie in [0, 1] (0 = start, 1 = end)")
        if any(n < 128 for n in self.context_lengths):
            raise ConfigError(f"task.context_lengths={self.context_lengths}: use at least 128 tokens")

    def samples(self, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        out = []
        for kind in self.kinds:
            for length in self.context_lengths:
                for pos in self.positions:
                    for i in range(self.samples_per_cell):
                        rng = random.Random(f"{self.seed}/{kind}/{length}/{pos}/{i}")
                        make = self._kv if kind == "kv" else self._fact
                        sample = make(tokenizer, rng, length, pos)
                        sample.id = f"{kind}-L{length}-p{pos:g}-{i}"
                        sample.cell = {"kind": kind, "context_length": length, "position": pos, "split": split_of(pos)}
                        out.append(sample)
        return out

    def _kv(self, tokenizer, rng: random.Random, length: int, pos: float) -> Sample:
        def uid() -> str:
            return str(uuid.UUID(int=rng.getrandbits(128), version=4))

        def render(pairs: list[tuple[str, str]]) -> str:
            body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in pairs)
            return "JSON data:\n{\n" + body + "\n}"

        pairs, total = [], count_tokens(tokenizer, render([]))
        while total < length:
            pairs.append((uid(), uid()))
            total += count_tokens(tokenizer, f"  {json.dumps(pairs[-1][0])}: {json.dumps(pairs[-1][1])},\n")
        while len(pairs) > 1 and count_tokens(tokenizer, render(pairs)) > length:
            pairs.pop()
        key, value = pairs[round(pos * (len(pairs) - 1))]
        return Sample(
            id="",
            context=render(pairs),
            cell={},
            answers=[value],
            question=f'Extract the value corresponding to the specified key in the JSON object above. Key: "{key}"',
            evidence=[f"{json.dumps(key)}: {json.dumps(value)}"],
            answer_prefix=f'The value associated with the key "{key}" is "',
        )

    def _fact(self, tokenizer, rng: random.Random, length: int, pos: float) -> Sample:
        role, item, place = rng.choice(_ROLES), rng.choice(_ITEMS), rng.choice(_PLACES)
        fact = f"The {role} keeps the {item} in the {place}."
        return Sample(
            id="",
            context=build_context(tokenizer, prose(rng), [(fact, pos)], length),
            cell={},
            answers=[place],
            question=f"Where does the {role} keep the {item}? Answer in a few words.",
            evidence=[fact],
            answer_prefix=f"The {role} keeps the {item} in the",
        )
