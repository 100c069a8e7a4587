"""The task suite: needle variants, middle-of-document, bring-your-own JSONL and label-free fidelity."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hydra.utils import instantiate

from evalkit.engine.divergence import logit_divergence
from evalkit.engine.engine import run_sample
from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant
from evalkit.tasks import contains_all, contains_any
from evalkit.tasks.fidelity import FidelityTask
from evalkit.tasks.jsonl import read_jsonl
from evalkit.tasks.middoc import MiddocTask
from evalkit.tasks.needle import NeedleTask, count_tokens
from evalkit.tasks.prompt import build_prompt
from tests.conftest import compose_config, policy, run_cli

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def task_from_yaml(name: str, *overrides: str):
    return instantiate(compose_config(f"task={name}", *overrides).task, _convert_="all")


@pytest.mark.parametrize("value_type", ["number", "word", "uuid"])
@pytest.mark.parametrize("variant", ["multikey", "multivalue", "multiquery"])
def test_needle_variants_place_every_needle_and_ask_for_the_right_values(tiny, variant, value_type):
    t = task_from_yaml(variant, f"task.value_type={value_type}", "task.context_lengths=[1500]", "task.depths=[0.5]")
    (s,) = t.samples(tiny.tokenizer)
    assert s == t.samples(tiny.tokenizer)[0], "deterministic for a seed"
    assert len(s.answers) == t.queries * t.values_per_key
    assert len(s.evidence) == len(s.answers)  # one needle sentence per asked value
    for needle in s.evidence:
        assert s.context.count(needle) == 1
    assert all(a in " ".join(s.evidence) for a in s.answers)
    assert s.context.count("One of the special magic") == t.keys * t.values_per_key  # asked + distractors
    if value_type == "uuid":
        assert all(UUID.match(a) for a in s.answers)
    assert count_tokens(tiny.tokenizer, s.context) <= 1500
    first = s.context.index(s.evidence[0]) if variant != "multiquery" else None
    if first is not None:  # the first asked needle sits at the cell's depth
        assert abs(count_tokens(tiny.tokenizer, s.context[:first]) / 1500 - 0.5) < 0.15


def test_ruler_scoring_all_and_any_are_case_insensitive():
    refs = ["Apple", "pear", "42"]
    assert contains_all("apple, PEAR and 42", refs) == 1.0
    assert contains_all("apple and 42", refs) == pytest.approx(2 / 3)
    assert contains_any("only PEAR here", refs) == 1.0
    assert contains_any("nothing", refs) == 0.0
    t = NeedleTask(keys=2, values_per_key=2, scoring="any")
    assert t.score("x", type("S", (), {"answers": ["a", "x"]})()) == 1.0


@pytest.mark.parametrize("kind", ["kv", "fact"])
def test_middoc_puts_the_answer_where_it_says(tiny, kind):
    t = MiddocTask(kinds=[kind], context_lengths=[800], positions=[0.0, 0.5, 0.95])
    samples = t.samples(tiny.tokenizer)
    assert samples == t.samples(tiny.tokenizer)
    assert [s.cell["split"] for s in samples] == ["other", "hard", "easy"]
    where = []
    for s in samples:
        (evidence,) = s.evidence
        assert s.context.count(evidence) == 1 and s.answers[0] in evidence
        where.append(count_tokens(tiny.tokenizer, s.context[: s.context.index(evidence)]) / 800)
        assert count_tokens(tiny.tokenizer, s.context) <= 800
    assert where[0] < 0.15 and abs(where[1] - 0.5) < 0.2 and where[2] > 0.7
    if kind == "kv":
        pairs = json.loads(samples[1].context.removeprefix("JSON data:\n"))
        assert len(pairs) > 3 and UUID.match(samples[1].answers[0]) and samples[1].answers[0] in pairs.values()


def write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps(
    {
        "id": "a",
        "context": "Tom has a cat.",
        "question": "Who has a cat?",
        "answers": ["Tom"],
        "meta": {"topic": "pets"},
    }
)


def test_jsonl_rows_become_samples_with_meta_as_breakdown_keys(tmp_path):
    (s,) = read_jsonl(write(tmp_path, [GOOD]))
    assert (s.id, s.context, s.question, s.answers, s.cell) == (
        "a",
        "Tom has a cat.",
        "Who has a cat?",
        ["Tom"],
        {"topic": "pets"},
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", ":2: not valid JSON"),
        (json.dumps({"id": "b", "question": "q", "answers": ["x"]}), ":2: field 'context' is missing"),
        (json.dumps({"id": "b", "context": " ", "question": "q", "answers": ["x"]}), ":2: field 'context' is empty"),
        (json.dumps({"id": "b", "context": "c", "question": "q", "answers": "x"}), ":2: field 'answers' must be"),
        (json.dumps({"id": "b", "context": "c", "question": "q", "answers": [3]}), ":2: field 'answers' must be"),
        (json.dumps({"id": "a", "context": "c", "question": "q", "answers": ["x"]}), ":2: field 'id': 'a' repeats"),
        ("[1, 2]", ":2: a row must be a JSON object"),
    ],
    ids=["bad-json", "missing", "empty", "answers-string", "answers-not-strings", "duplicate-id", "not-object"],
)
def test_jsonl_validation_names_file_line_and_field(tmp_path, line, message):
    path = write(tmp_path, [GOOD, line])
    with pytest.raises(ConfigError, match=re.escape(f"{path}{message}")):
        read_jsonl(path)


def test_jsonl_reports_every_bad_row_and_stops_before_the_model_loads(tmp_path):
    path = write(tmp_path, [GOOD, "{", json.dumps({"id": "c"})])
    result = run_cli(
        "model=hf",
        "model.name_or_path=/nonexistent",
        "model.max_context=4096",
        "task=jsonl",
        f"task.path={path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 2
    assert f"{path}:2: not valid JSON" in result.stderr and f"{path}:3: field 'context' is missing" in result.stderr
    with pytest.raises(ConfigError, match="is not a file"):
        read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="holds no rows"):
        read_jsonl(write(tmp_path, [""]))


def test_fidelity_metrics_on_hand_made_logits():
    same = [torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 3.0, 0.0])]
    m = logit_divergence(same, same, [0, 1])
    assert m["kl_mean"] == 0.0 and m["top1_agreement"] == 1.0 and m["ppl_ratio"] == 1.0
    other = [torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 3.0, 0.0])]
    m = logit_divergence(same, other, [0, 1])
    p, q = torch.tensor([2.0, 0.0, 0.0]).log_softmax(0), torch.tensor([0.0, 1.0, 0.0]).log_softmax(0)
    assert m["kl_mean"] == pytest.approx(float((p.exp() * (p - q)).sum()) / 2, rel=1e-5)  # 2nd position: KL 0
    assert m["top1_agreement"] == 0.5
    assert m["ppl_ratio"] == pytest.approx(float(torch.exp((p[0] - q[0]) / 2)), rel=1e-5)


def test_fidelity_at_full_budget_is_exact_and_compression_moves_it(tiny):
    t = FidelityTask(context_lengths=[200], continuation_tokens=12, samples_per_cell=1)
    (s,) = t.samples(tiny.tokenizer)
    assert s.continuation and not s.question
    p = build_prompt(tiny.tokenizer, s)
    assert p.ids.shape[1] - p.n_context == 12
    variants = [Variant(policy("snapkv", 1.0)), Variant(policy("streaming_llm", 16))]
    base, (full, small) = run_sample(tiny.model, p, variants, 0, set(), forced=True)
    targets = p.ids[0, p.n_context + 1 :].tolist()
    assert len(base.logits) == 11 and logit_divergence(base.logits, full.logits, targets)["kl_mean"] == 0.0
    assert logit_divergence(base.logits, small.logits, targets)["kl_mean"] > 0.0


def test_fidelity_over_jsonl_contexts(tiny, tmp_path):
    row = {"id": "doc", "context": "word " * 200, "question": "q", "answers": ["a"], "meta": {"src": "mine"}}
    t = FidelityTask(path=str(write(tmp_path, [json.dumps(row)])), continuation_tokens=20)
    t.validate()
    (s,) = t.samples(tiny.tokenizer)
    assert s.context + s.continuation == row["context"] and s.cell == {"src": "mine", "source": "jsonl"}


def test_fidelity_refuses_the_query_aware_protocol(tmp_path):
    result = run_cli(
        "model=hf",
        "model.name_or_path=/nonexistent",
        "model.max_context=4096",
        "task=fidelity",
        "protocol=query_aware",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 2 and "use protocol=query_agnostic" in result.stderr


def test_middoc_run_reports_easy_and_hard_side_by_side(tmp_path):
    result = run_cli(
        "model=tiny-random",
        "task=middoc",
        "task.context_lengths=[200]",
        "policy=streaming_llm",
        "policy.budget=32",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"streaming_llm@32: easy .* \| hard .* \| other", result.stdout)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["streaming_llm@32"]["splits"]) == {"easy", "hard", "other"}
