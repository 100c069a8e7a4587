"""task=hf: Hugging Face datasets (save_to_disk folders, parquet, JSON), kvpress's layout and column mappings, one
prefill per context for several questions, truncation, the offline error, and each benchmark family's scorer on
hand-checked examples (the expected numbers are worked out in the comments, from the metric's definition)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from datasets import Dataset

from evalkit.engine.engine import compress_context, decode, run_sample
from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant
from evalkit.scoring import infinitebench, longbench, loogle, needle_in_haystack, ruler, zero_scrolls
from evalkit.tasks.hf import HfTask
from evalkit.tasks.prompt import build_prompt
from tests.conftest import policy, run_cli

FILL = "The grass is green and the sky is blue. " * 6
KVPRESS = {  # kvpress's layout: two questions on context A, one on context B
    "context": [FILL + "The magic number is 4711. " + FILL] * 2 + [FILL + "The colour is teal. " + FILL],
    "question": ["What is the magic number?", "Say the magic number again.", "What colour is it?"],
    "answer_prefix": ["Answer:", "The number is", "The colour is"],
    "answer": [["4711"], ["4711"], ["teal"]],
    "max_new_tokens": [3, 5, 2],
    "task": ["niah_single_1", "niah_single_1", "qa_1"],
}


def task(path, **kw) -> HfTask:
    t = HfTask(path=str(path), **kw)
    t.validate()
    return t


# --- loading: every local form, the mapping, the subset -----------------------------------------------------------


def test_kvpress_layout_from_save_to_disk_parquet_and_json_gives_the_same_rows(tmp_path):
    """The three local forms give the same samples, with kvpress's columns read as is: answer_prefix, the per-row
    max_new_tokens and the `task` column as the breakdown key `subtask`. Catches a form read differently, a column
    ignored, or the questions on one context split apart (they must be adjacent, for one shared prefill)."""
    ds = Dataset.from_dict(KVPRESS)
    ds.save_to_disk(tmp_path / "disk")
    ds.to_parquet(tmp_path / "d.parquet")
    ds.to_json(tmp_path / "d.jsonl")
    got = [task(tmp_path / p) for p in ("disk", "d.parquet", "d.jsonl")]
    for t in got:
        assert [(r.sample.question, r.sample.answer_prefix, r.sample.cell) for r in t.rows] == [
            (q, p, {"subtask": s})
            for q, p, s in zip(KVPRESS["question"], KVPRESS["answer_prefix"], KVPRESS["task"], strict=True)
        ]
        assert [t.answer_tokens(r.sample) for r in t.rows] == [3, 5, 2]
        assert t.rows[0].sample.context == t.rows[1].sample.context != t.rows[2].sample.context


def test_column_mapping_and_a_string_answer(tmp_path):
    """`task.columns.context=document` etc. map another layout; a plain string answer becomes a one-item list; a
    dataset without max_new_tokens takes task.max_new_tokens. Catches the mapping ignored or a string answer split
    into characters."""
    Dataset.from_dict({"document": ["doc " * 40], "query": ["q?"], "gold": ["cello"], "kind": ["music"]}).to_parquet(
        tmp_path / "m.parquet"
    )
    t = task(
        tmp_path / "m.parquet",
        columns={"context": "document", "question": "query", "answers": "gold", "subtask": "kind"},
        max_new_tokens=9,
    )
    (r,) = t.rows
    assert (r.sample.context, r.sample.question, r.sample.answers, r.sample.cell) == (
        "doc " * 40,
        "q?",
        ["cello"],
        {"subtask": "music"},
    )
    assert t.answer_tokens(r.sample) == 9


def test_bad_rows_are_named_by_index_and_column_all_at_once(tmp_path):
    """Like JSONL: every bad row, by its index in the dataset and its column, before any model loads. Catches a
    validation that stops at the first problem or names evalkit's field instead of the dataset's column."""
    Dataset.from_dict(
        {"context": ["ok " * 20, "", "ok " * 20], "question": ["q", "q", "q"], "gold": [["a"], ["b"], []]}
    ).save_to_disk(tmp_path / "bad")
    with pytest.raises(ConfigError) as err:
        task(tmp_path / "bad", columns={"answers": "gold"})
    text = str(err.value)
    assert "2 bad row(s)" in text
    assert "row 1: column 'context' is empty" in text
    assert "row 2: column 'gold' must be a non-empty list" in text
    with pytest.raises(ConfigError, match="no column for context .column 'text'"):
        task(tmp_path / "bad", columns={"context": "text", "answers": "gold"})


def test_limit_and_fraction_take_a_seeded_subset(tmp_path):
    """limit/fraction: that many rows, chosen at random by the seed, the same for the same seed. Catches the first
    rows taken always (not a random subset), or a subset that changes between runs of the same seed."""
    n = 40
    Dataset.from_dict(
        {"context": [f"context {i} " * 10 for i in range(n)], "question": ["q"] * n, "answer": [["a"]] * n}
    ).save_to_disk(tmp_path / "many")
    a = [r.index for r in task(tmp_path / "many", limit=5, seed=1).rows]
    b = [r.index for r in task(tmp_path / "many", limit=5, seed=1).rows]
    c = [r.index for r in task(tmp_path / "many", limit=5, seed=2).rows]
    assert a == b and len(a) == 5 and a != c and a != [0, 1, 2, 3, 4]
    assert len(task(tmp_path / "many", fraction=0.25).rows) == 10  # 0.25 x 40


def test_a_larger_limit_keeps_every_row_of_a_smaller_one(tmp_path):
    """The gate's advice `task.limit=N resume=true` extends a run: the subsets of one seed are nested, so the rows
    already run stay in the run. Python's random.sample is not nested across sizes (it switches algorithm with k):
    the first limits below would drop rows with it."""
    n = 200
    Dataset.from_dict(
        {"context": [f"context {i} " * 4 for i in range(n)], "question": ["q"] * n, "answer": [["a"]] * n}
    ).save_to_disk(tmp_path / "many")
    subsets = [{r.index for r in task(tmp_path / "many", limit=k, seed=3).rows} for k in (5, 20, 59, 130)]
    assert [len(s) for s in subsets] == [5, 20, 59, 130]
    assert all(small < big for small, big in itertools.pairwise(subsets))
    assert {r.index for r in task(tmp_path / "many", fraction=0.3, seed=3).rows} > subsets[2]  # 60 rows


# --- one prefill for several questions ------------------------------------------------------------------------------


def test_questions_on_one_context_share_a_prefill_and_answer_as_if_run_alone(tiny, tmp_path):
    """Compress once, decode several questions: the second question on a context decodes from copies of the caches
    compress_context made (no prefill, no compression): its tokens are exactly those of a fresh run_sample, for the
    baseline and a SnapKV variant that evicts while decoding, even for a third question after two decodes from the
    stored caches. Catches a stored cache mutated by a decode (a later answer would then attend to an earlier one's
    tokens)."""
    Dataset.from_dict(KVPRESS).save_to_disk(tmp_path / "d")
    t = task(tmp_path / "d", context_window=4096)
    samples = t.samples(tiny.tokenizer)
    prompts = [build_prompt(tiny.tokenizer, s) for s in samples[:2]]
    assert torch.equal(prompts[0].ids[:, : prompts[0].n_context], prompts[1].ids[:, : prompts[1].n_context])
    pol = policy("snapkv", 0.5, decode=True)
    variants = [Variant(pol)]
    compressed = compress_context(tiny.model, prompts[0].ids[:, : prompts[0].n_context], variants)

    def ask(prompt):
        return decode(tiny.model, compressed, prompt.ids[:, prompt.n_context :], 6, set(), evidence=prompt.evidence)

    first_base, _ = ask(prompts[0])
    ask(prompts[1])
    base, outs = ask(prompts[1])  # a third question
    fresh_base, fresh_outs = run_sample(tiny.model, prompts[1], variants, 6, set())
    assert base.tokens == fresh_base.tokens and outs[0].tokens == fresh_outs[0].tokens
    assert outs[0].tokens_held == fresh_outs[0].tokens_held
    assert base.seconds["prefill"] == 0.0 and outs[0].seconds["compress"] == 0.0
    assert first_base.seconds["prefill"] > 0.0  # the first decode's rows carry the prefill's seconds


# --- truncation -------------------------------------------------------------------------------------------------------


def test_truncation_keeps_the_first_and_last_halves_and_is_recorded(tiny, tmp_path):
    """A context over the window is cut in its middle (LongBench): the prompt then fits window - answer tokens, the
    start and the end of the context survive, and the record says how many tokens were kept; refuse stops instead.
    Catches a cut at the end (the tail would be lost) or a prompt that still overflows."""
    Dataset.from_dict(
        {"context": ["BEGIN " + "x y z " * 200 + " END"], "question": ["q?"], "answer": [["a"]], "max_new_tokens": [4]}
    ).save_to_disk(tmp_path / "long")
    t = task(tmp_path / "long", context_window=300)
    (s,) = t.samples(tiny.tokenizer)
    assert s.context.startswith("BEGIN") and s.context.endswith("END") and len(s.context) < 600
    assert build_prompt(tiny.tokenizer, s).ids.shape[1] + 4 <= 300
    record = t.row_fields(s)["truncation"]
    assert record["mode"] == "middle" and record["window"] == 300 and record["kept_tokens"] < record["context_tokens"]
    with pytest.raises(ConfigError, match="task.truncate=middle"):
        task(tmp_path / "long", context_window=300, truncate="refuse").samples(tiny.tokenizer)


# --- end to end, and offline ------------------------------------------------------------------------------------------


def test_cli_run_records_rows_subtasks_prefix_budget_and_truncation(tmp_path):
    """`python -m evalkit task=hf` on the tiny model: one row per (dataset row, variant), the subtask as the cell,
    each row's own max_new_tokens bounding its answer, the answer prefix in the prompt (more prompt tokens than
    without), a truncation record, and the second question on context A prefilled by the first. Catches per-row
    fields lost between the dataset and the records."""
    Dataset.from_dict(KVPRESS).save_to_disk(tmp_path / "d")
    out = tmp_path / "run"
    res = run_cli(
        "task=hf",
        f"task.path={tmp_path / 'd'}",
        "task.scorer=ruler",
        "task.context_window=300",
        "model=tiny-random",
        "policy=streaming_llm",
        "policy.budget=0.5",
        f"hydra.run.dir={out}",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["variant"] for r in rows} == {"baseline", "streaming_llm@0.5"}
    by = {(r["sample_id"], r["variant"]): r for r in rows}
    for sid, budget, subtask in [("0", 3, "niah_single_1"), ("1", 5, "niah_single_1"), ("2", 2, "qa_1")]:
        r = by[(sid, "baseline")]
        assert r["cell"] == {"subtask": subtask} and r["generated_tokens"] <= budget
        assert r["truncation"]["mode"] == "middle" and r["source"]["row"] == int(sid)
    assert by[("1", "baseline")]["seconds"]["prefill"] == 0.0 < by[("0", "baseline")]["seconds"]["prefill"]
    summary = json.loads((out / "summary.json").read_text())
    assert "subtask=qa_1" in json.dumps(summary)


def test_offline_without_a_local_copy_is_one_line_exit_2(tmp_path):
    """HF_DATASETS_OFFLINE=1 and a Hub id with no copy: exit 2 before any model loads, one line naming the dataset
    and the command that fetches it on a connected machine. Catches a traceback, a hang on the network, or a message
    without the fix."""
    res = run_cli(
        "task=ruler",
        "task.path=nobody-here/no-such-dataset",
        "model=tiny-random",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
        timeout=120,
        process=True,  # the Hub's libraries read these variables when first imported: a fresh process
    )
    assert res.returncode == 2, res.stderr[-2000:]
    err = [line for line in res.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "nobody-here/no-such-dataset" in err[0] and "offline" in err[0]
    assert "save_to_disk" in err[0] and "data_dir='4096'" in err[0] and "Traceback" not in res.stderr


# --- scorers, each on hand-checked examples -------------------------------------------------------------------------


def test_ruler_string_match_all_and_part():
    """RULER: niah/vt/cwe/fwe need every reference (share found), qa any one. Catches all/part swapped."""
    # "12" and "34" found, "56" not: 2 of 3
    assert ruler.score("The numbers are 12 and 34.", ["12", "34", "56"], "niah_multivalue") == pytest.approx(2 / 3)
    # qa: one of the references suffices, case-insensitively
    assert ruler.score("it is london", ["Paris", "London"], "qa_1") == 1.0
    assert ruler.score("it is\n lon\ndon", ["London"], "qa_2") == 1.0  # control characters removed: "it is londondon"


def test_longbench_metrics():
    """LongBench's metrics on hand-worked cases. Catches a wrong normalisation, F1 formula, metric per task,
    first-line rule or reference maximum."""
    # QA F1: "eiffel tower in paris" vs "eiffel tower": 2 shared, P = 2/4, R = 2/2, F1 = 2*.5*1/1.5 = 2/3
    assert longbench.score("The Eiffel Tower in Paris", ["Eiffel Tower"], "hotpotqa") == pytest.approx(2 / 3)
    # best over the references
    assert longbench.score("unanswerable", ["no", "unanswerable"], "qasper") == 1.0
    # ROUGE-L: LCS("the cat sat on the mat", "the cat on the mat") = 5, P = 5/6, R = 5/5, F = 10/11
    assert longbench.score("the cat sat on the mat", ["the cat on the mat"], "gov_report") == pytest.approx(10 / 11)
    classes = {"all_classes": ["Location", "Number", "Entity"]}
    # classification: two classes said, one is the answer: 1/2; trec reads only the first line: 1
    assert longbench.score("Location or Number", ["Location"], "trec", classes) == 0.5
    assert longbench.score("Location\nNumber", ["Location"], "trec", classes) == 1.0
    # retrieval: numbers said 7 and 12, the answer is 7: 1/2
    assert longbench.score("Paragraph 7, not Paragraph 12", ["Paragraph 7"], "passage_retrieval_en") == 0.5
    # count: numbers said 5 and 9, the count is 5: 1/2
    assert longbench.score("There are 5 unique paragraphs out of 9", ["5"], "passage_count") == 0.5
    # code: the first line without a comment is "return a + b"; vs "return a - b" (12 chars each), one character
    # substituted = 2 Indel edits: 1 - 2/24 = 11/12
    assert longbench.score("# add\nreturn a + b\n", ["return a - b"], "lcc") == pytest.approx(11 / 12)
    assert longbench.check("dureader") and longbench.check("nosuch") and longbench.check("qasper") is None


def test_infinitebench_metrics():
    """InfiniteBench's per-task rules on hand-worked cases. Catches a task scored by another task's rule."""
    assert infinitebench.score("The pass key is 71432.", ["71432"], "passkey") == 1.0
    assert infinitebench.score("The pass key is 7143 2.", ["71432"], "passkey") == 0.0  # first run of digits: 7143
    assert infinitebench.score('value is "abc-def".', ["abc-def"], "kv_retrieval") == 1.0
    # math_calc: 1 and 4 right, then 9 where 8 was due: 2 of 3
    assert infinitebench.score("Values: [1, 4, 9]", ["1", "4", "8"], "math_calc") == pytest.approx(2 / 3)
    assert infinitebench.score("The answer is B", ["B"], "longbook_choice_eng") == 1.0
    assert infinitebench.score("A", ["B"], "longbook_choice_eng") == 0.0
    assert infinitebench.score("The return value is: -12", ["-12"], "code_run") == 1.0
    # Chinese character F1: 小明 vs 小明同学: 2 shared, P = 1, R = 1/2, F1 = 2/3
    assert infinitebench.score("小明", ["小明同学"], "longbook_qa_chn") == pytest.approx(2 / 3)


def test_loogle_zero_scrolls_and_needle_metrics():
    """LooGLE (ROUGE-L recall, cloze exact match), ZeroSCROLLS (ROUGE geometric mean, exact match) and the needle's
    ROUGE-L recall, on hand-worked cases. Catches recall/F1 swapped or the cloze scored as text."""
    # LCS([a cat on a mat], [the cat sat on the mat]) = cat on mat = 3; recall = 3/6
    assert loogle.score("a cat on a mat", ["the cat sat on the mat"], "shortdep_qa") == pytest.approx(0.5)
    ref = json.dumps({"<mask-0>": "Bob", "<mask-1>": "Paris"})
    assert loogle.score("{'<mask-0>': 'Bob', '<mask-1>': 'Rome'}", [ref], "shortdep_cloze") == 0.5
    assert loogle.score("Bob and Paris", [ref], "shortdep_cloze") == 0.0
    # "the cat" vs "the cat sat": R1 F = 0.8, R2 F = 2/3 (1 of 2 bigrams, P = 1), RL F = 0.8; (0.8*2/3*0.8)^(1/3)
    assert zero_scrolls.score("the cat", ["the cat sat"], "gov_report") == pytest.approx((0.8 * 2 / 3 * 0.8) ** (1 / 3))
    assert zero_scrolls.score("(B) yes", ["(B) Yes."], "quality") == 1.0
    # 12 needle words; "eat a sandwich" in order: 3/12
    needle = "The best thing to do in San Francisco is eat a sandwich"
    assert needle_in_haystack.score("eat a sandwich in Dolores Park", [needle], "") == pytest.approx(0.25)


def test_needle_in_haystack_inserts_the_needle_at_each_depth(tiny, tmp_path):
    """kvpress's needle layout (context, needle, question, answer_prefix, max_new_tokens; no answer column): one
    sample per depth, the essay cut to needle_context_length - needle - 150 tokens, the needle at depth% of it, the
    needle as the answer, depth as a breakdown key. Catches a needle put at the same place for every depth."""
    essay = "".join(chr(97 + i % 26) for i in range(2000))  # byte-level tokenizer: one token a character
    Dataset.from_dict(
        {
            "context": [essay],
            "needle": [" NEEDLE "],
            "question": ["What is hidden?"],
            "answer_prefix": ["It is"],
            "max_new_tokens": [4],
        }
    ).save_to_disk(tmp_path / "pg")
    t = task(tmp_path / "pg", scorer="needle", needle_depths=[0, 50, 100], needle_context_length=400)
    samples = t.samples(tiny.tokenizer)
    assert [s.cell["depth"] for s in samples] == [0, 50, 100] and all(s.answers == [" NEEDLE "] for s in samples)
    book = [s.context.removeprefix("This is a very long story book: <book> ") for s in samples]
    # 400 - 8 needle tokens - 150 = 242 essay tokens; the needle after 0, 121 and 242 of them
    assert [b.index("NEEDLE") - 1 for b in book] == [0, 121, 242]


def test_advice_never_asks_a_dataset_for_rows_it_does_not_have(tmp_path):
    """An INCONCLUSIVE run of both rows of a 2-row dataset (task.limit null): before, the advice said
    `task.limit=74 resume=true`, which runs the same 2 rows again and loops. Now: the dataset is exhausted, and no
    command to extend is printed. Control: 2 of KVPRESS's 3 rows (task.limit=2) may be extended with task.limit."""
    two = {k: v[:1] + v[2:] for k, v in KVPRESS.items()}  # contexts A and B, one question each
    Dataset.from_dict(two).save_to_disk(tmp_path / "two")
    Dataset.from_dict(KVPRESS).save_to_disk(tmp_path / "three")
    gate = ["gate=default", "gate.min_baseline_accuracy=null", "model=tiny-random", "policy=streaming_llm"]
    common = ["task=hf", "task.scorer=ruler", "task.context_window=300", "policy.budget=0.5", *gate]
    res = run_cli(*common, f"task.path={tmp_path / 'two'}", f"hydra.run.dir={tmp_path / 'a'}")
    assert res.returncode == 2 and "evalkit gate: INCONCLUSIVE" in res.stdout, res.stderr[-2000:]
    assert "the dataset is exhausted: all its 2 rows were run, so no task.limit adds any" in res.stdout
    assert "task.limit=" not in res.stdout and "to extend the run" not in res.stdout
    res = run_cli(*common, f"task.path={tmp_path / 'three'}", "task.limit=2", f"hydra.run.dir={tmp_path / 'b'}")
    assert res.returncode == 2 and "evalkit gate: INCONCLUSIVE" in res.stdout, res.stderr[-2000:]
    assert "exhausted" not in res.stdout and "resume=true" in res.stdout and "task.limit=" in res.stdout
