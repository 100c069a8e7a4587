"""The needle task: deterministic, the needle where it says, lengths in the model's tokens, scoring by containment."""

from __future__ import annotations

import re

import pytest
import torch

from evalkit.tasks import contains_any
from evalkit.tasks.haystack import NOISE
from evalkit.tasks.needle import NeedleTask, count_tokens
from evalkit.tasks.prompt import build_prompt


def task(**kw) -> NeedleTask:
    return NeedleTask(**{"context_lengths": [300], "depths": [0.0, 0.5, 1.0], **kw})


@pytest.mark.parametrize("haystack", ["noise", "prose"])
def test_samples_are_deterministic_for_a_seed(tiny, haystack):
    a = task(haystack=haystack).samples(tiny.tokenizer)
    b = task(haystack=haystack).samples(tiny.tokenizer)
    c = task(haystack=haystack, seed=1).samples(tiny.tokenizer)
    assert a == b
    assert [s.answers for s in a] != [s.answers for s in c]


@pytest.mark.parametrize("haystack", ["noise", "prose"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_sits_at_its_depth_within_the_token_length(tiny, haystack, depth):
    (s,) = task(context_lengths=[400], depths=[depth], haystack=haystack).samples(tiny.tokenizer)
    n = count_tokens(tiny.tokenizer, s.context)
    needle = s.evidence[0]
    longest = max(count_tokens(tiny.tokenizer, " " + x) for x in re.split(r"(?<=\.) ", s.context))
    assert 400 - longest < n <= 400  # short of the length by less than one sentence
    assert s.context.count(needle) == 1 and s.answers[0] in needle
    before = count_tokens(tiny.tokenizer, s.context[: s.context.index(needle)])
    assert abs(before / n - depth) <= 0.15
    assert s.cell == {"context_length": 400, "depth": depth, "haystack": haystack}


def test_prose_haystack_is_varied_and_holds_no_digits_but_the_needle(tiny):
    (s,) = task(context_lengths=[3000], depths=[0.5], haystack="prose").samples(tiny.tokenizer)
    filler = s.context.replace(s.evidence[0], "")
    assert not re.search(r"\d", filler)
    sentences = [x for x in re.split(r"(?<=\.) ", filler) if x]
    assert len(set(sentences)) > len(NOISE) * 2


def test_grid_is_lengths_by_depths_by_samples(tiny):
    samples = task(context_lengths=[200, 300], depths=[0.0, 1.0], samples_per_cell=3).samples(tiny.tokenizer)
    assert len(samples) == 12 == len({s.id for s in samples})


def test_scoring_is_case_insensitive_containment():
    assert contains_any("The number is 1234567.", ["1234567"]) == 1.0
    assert contains_any("the NUMBER is ABC-def", ["abc-DEF"]) == 1.0
    assert contains_any("The number is 123456", ["1234567"]) == 0.0
    assert contains_any("", ["1"]) == 0.0


def test_prompt_split_is_a_token_boundary_of_the_joined_prompt(tiny):
    (s,) = task(depths=[0.5]).samples(tiny.tokenizer)
    p = build_prompt(tiny.tokenizer, s)
    text = tiny.tokenizer.decode(p.ids[0])
    assert tiny.tokenizer.decode(p.ids[0, p.n_context :]).startswith("Question: " + s.question)
    assert s.context in tiny.tokenizer.decode(p.ids[0, : p.n_context])
    assert tiny.tokenizer.decode(p.ids[0, p.evidence]) == s.evidence[0]
    assert text.endswith("Answer: " + s.answer_prefix)


def test_query_aware_protocol_compresses_the_question_too(tiny):
    (s,) = task(depths=[0.5]).samples(tiny.tokenizer)
    agnostic, aware = build_prompt(tiny.tokenizer, s), build_prompt(tiny.tokenizer, s, "query_aware")
    assert torch.equal(agnostic.ids, aware.ids) and agnostic.evidence == aware.evidence
    assert aware.n_context == aware.ids.shape[1] - 1 > agnostic.n_context
