"""Filler text for retrieval tasks: the classic repeated noise, or varied prose generated from a seed."""

from __future__ import annotations

import random
from collections.abc import Iterator

NOISE = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]

_SUBJECTS = [
    "The old lighthouse keeper",
    "A quiet river",
    "The city council",
    "Every traveller",
    "The young painter",
    "A flock of starlings",
    "The morning train",
    "Our neighbour",
    "The village library",
    "A wandering merchant",
    "The ship's cook",
    "The orchestra",
    "A curious child",
    "The night watchman",
    "The mountain guide",
    "An elderly botanist",
    "The baker on the corner",
    "A stray dog",
    "The harbour master",
    "The schoolteacher",
]
_VERBS = [
    "watched",
    "remembered",
    "carried",
    "painted",
    "followed",
    "described",
    "ignored",
    "welcomed",
    "measured",
    "forgot",
    "repaired",
    "admired",
    "questioned",
    "sketched",
    "collected",
    "praised",
    "avoided",
    "studied",
]
_OBJECTS = [
    "the distant hills",
    "a letter from the coast",
    "the autumn harvest",
    "an unfinished map",
    "the broken clock",
    "a basket of apples",
    "the narrow bridge",
    "the evening sky",
    "a forgotten song",
    "the empty market",
    "the winding road",
    "a box of old photographs",
    "the copper kettle",
    "the garden wall",
    "a heavy wooden door",
    "the frozen lake",
    "a pair of leather boots",
    "the lanterns by the gate",
]
_CLAUSES = [
    "before the rain began",
    "while the bells rang",
    "without saying a word",
    "as the fog lifted",
    "long after sunset",
    "on the first warm morning",
    "during the long winter",
    "with great care",
    "for no particular reason",
    "while the kettle boiled",
    "under a pale moon",
    "as the tide came in",
    "after the festival ended",
    "in the quiet hour before dawn",
    "beside the old stone well",
]
_EXTRAS = [
    "Nobody could say why.",
    "It had happened before.",
    "The wind picked up slightly.",
    "Someone laughed in the distance.",
    "The air smelled of salt and pine.",
    "It was an ordinary day.",
]


def noise() -> Iterator[str]:
    """The classic needle-in-a-haystack filler, repeated forever."""
    while True:
        yield from NOISE


def prose(rng: random.Random) -> Iterator[str]:
    """Varied sentences assembled from word lists; deterministic for the generator's seed, free of digits."""
    while True:
        if rng.random() < 0.15:
            yield rng.choice(_EXTRAS)
        else:
            yield f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_CLAUSES)}."


HAYSTACKS = {"noise": lambda rng: noise(), "prose": prose}
