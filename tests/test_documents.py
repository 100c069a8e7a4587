"""The document is the unit, and the KL a bound that holds.

Questions on one document share its fate whether or not they share a prefill: under protocol=query_aware each
question compresses the document with itself, so each has its own context_id, and a gate that counted contexts
PASSed one document with 60 questions plus 20 one-question documents as 80 independent samples. The cases start
from real run folders (tiny-random, task=hf, query_aware) and are judged by the gate's command line; the controls
beside them are the same runs, untouched. Expected counts are derived in the comments, never printed from the code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalkit.cli.gate import main
from evalkit.records import read_rows
from evalkit.tasks import Sample
from evalkit.tasks.prompt import build_prompt
from evalkit.thresholds import Thresholds
from tests.conftest import compose_config, judge_rows
from tests.test_evidence import copy, edit_rows
from tests.test_gate import rows

FILLER = "The grass is green and the sky is blue. "


def documents(single: int, questions: int) -> list[tuple[str, str]]:
    """(context, question) of `single` documents with one question each, then one document with `questions`."""
    out = [
        (f"Document {i}: the code word is w{i}. " + FILLER * 3, f"Document {i}: the code word?") for i in range(single)
    ]
    shared = "The shared document: its code word is shared. " + FILLER * 3
    return out + [(shared, f"Question {q} on the shared document: the code word?") for q in range(questions)]


def dataset(path: Path, pairs: list[tuple[str, str]], answers: dict[str, str]) -> Path:
    """A kvpress-layout JSONL of (context, question) pairs, each answered by answers[question] (else "w")."""
    with path.open("w") as f:
        for context, question in pairs:
            row = {"context": context, "question": question, "answer": answers.get(question) or "w"}
            f.write(json.dumps({**row, "max_new_tokens": 2}) + "\n")
    return path


def real_run(folder: Path, data: Path) -> Path:
    """A query_aware run written by evalkit itself (evalkit.cli.job.run, the command line's code, in this process):
    the full cache and a variant that keeps every token (none@1.0: lossless by construction)."""
    from evalkit.cli.job import job_spec, run

    overrides = ["model=tiny-random", "task=hf", f"task.path={data}", "task.split=train", "protocol=query_aware"]
    run(*job_spec(compose_config(*overrides, "variants=[none@1.0]"), folder))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A crowded document beside single ones: 20 one-question documents and 60 questions on a 21st (`crowded`, 80
    questions); and 75 one-question documents and 5 questions on a 76th (`enough`: 76 documents, enough for a
    lossless PASS by betting). The tiny random model answers nothing right, so a first run finds what its full cache
    answers each question (the prompt holds no answer: the same prompts give the same predictions), and the two runs
    take those answers as the references: a task the full cache does, with nothing given away to the variant."""
    root = tmp_path_factory.mktemp("documents")
    union = documents(75, 60)
    first = real_run(root / "first", dataset(root / "first.jsonl", union, {}))
    said = {r["question"]: r["prediction"] for r in read_rows(first / "samples.jsonl") if r["variant"] == "baseline"}
    out = {}
    for name, (single, questions) in {"crowded": (20, 60), "enough": (75, 5)}.items():
        out[name] = real_run(root / name, dataset(root / f"{name}.jsonl", documents(single, questions), said))
    return out


def gate(capsys, folder: Path) -> tuple[int, str, dict]:
    code = main([str(folder)])
    out, _ = capsys.readouterr()
    verdict = folder / "verdict.json"
    return code, out, json.loads(verdict.read_text()) if verdict.exists() else {}


# --- the document, recorded -------------------------------------------------------------------------------------


def test_the_document_id_is_the_same_whatever_the_question_and_the_protocol(tiny):
    text = "The magic number is 4711. " + FILLER * 4
    one, two = (Sample(q, text, q, ["4711"], {}) for q in ("Which number?", "Say it."))
    other = Sample("c", text.replace("4711", "4712"), "Which number?", ["4712"], {})
    aware = [build_prompt(tiny.tokenizer, s, "query_aware") for s in (one, two, other)]
    agnostic = [build_prompt(tiny.tokenizer, s, "query_agnostic") for s in (one, two, other)]
    # query_aware compresses the question too: two questions, two contexts, one document
    assert aware[0].context_id != aware[1].context_id and aware[0].document_id == aware[1].document_id
    # the same document under either protocol; query_agnostic prefills exactly the document
    assert [p.document_id for p in aware] == [p.document_id for p in agnostic]
    assert all(p.document_id == p.context_id for p in agnostic)
    assert aware[0].document_id != aware[2].document_id  # another text, another document


def test_every_row_of_a_query_aware_run_names_its_document(runs):
    rows_ = read_rows(runs["crowded"] / "samples.jsonl")
    variant = [r for r in rows_ if r["variant"] != "baseline"]
    assert len(variant) == 80 and all(r["protocol"] == "query_aware" for r in variant)
    # 80 questions, each compressed with its own question: 80 contexts; 20 + 1 documents
    assert len({r["context_id"] for r in variant}) == 80
    assert len({r["document_id"] for r in variant}) == 21
    shared = {r["document_id"] for r in variant if int(r["sample_id"]) >= 20}
    assert len(shared) == 1


# --- case 1: the gate counts documents -----------------------------------------------------------------------------


def test_many_questions_on_one_document_are_one_context_whatever_the_protocol(runs, capsys, tmp_path):
    # 80 questions, none lost. Counted as 80 independent contexts, the exact first look PASSed (0 lost of 80, from
    # 59). They are 21 documents: fewer than gate.min_samples=59, so nothing can PASS them.
    code, out, verdict = gate(capsys, copy(runs, "crowded", tmp_path))
    assert code == 2 and "evalkit gate: INCONCLUSIVE" in out, out
    assert verdict["variants"]["none@1.0"]["gate"]["contexts"] == 21
    assert verdict["variants"]["none@1.0"]["gate"]["questions"] == 80
    # the control: 76 documents (75 + one with 5 questions), nothing lost, PASS by betting (from 74 documents)
    code, out, verdict = gate(capsys, copy(runs, "enough", tmp_path))
    assert code == 0 and "evalkit gate: PASS" in out, out
    assert verdict["variants"]["none@1.0"]["gate"]["contexts"] == 76


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # the rows of query_aware runs written before documents were recorded: the unit cannot be known
        (lambda r: r.pop("document_id"), "protocol=query_aware rows without document_id"),
        # a variant row that names another document than its baseline row
        (
            lambda r: r.update(document_id="0" * 16) if r["variant"] != "baseline" and r["sample_id"] == "3" else None,
            "document_id='0000000000000000' but the baseline row's document_id",
        ),
        # every question its own document: the baseline row and the variant row edited alike, caught under
        # query_agnostic, where the prefilled context is the document
        (
            lambda r: r.update(protocol="query_agnostic", document_id=f"{int(r['sample_id']):016x}"),
            "under protocol=query_agnostic the prefilled context is the document",
        ),
    ],
    ids=["deleted", "against-its-baseline", "not-its-context"],
)
def test_a_document_id_the_records_contradict_cannot_be_judged(runs, capsys, tmp_path, edit, message):
    folder = copy(runs, "crowded", tmp_path)
    edit_rows(folder, edit)
    code, out, _ = gate(capsys, folder)
    assert code == 2 and "evalkit gate: CANNOT JUDGE" in out and message in out, out


def test_rows_of_one_context_name_one_document(runs, capsys, tmp_path):
    # questions compressed from the same context were asked on the same document: samples 0 and 1 (two documents)
    # made to share a context is an edit
    folder = copy(runs, "crowded", tmp_path)
    same = "c" * 16
    edit_rows(folder, lambda r: r.update(context_id=same) if r["sample_id"] in ("0", "1") else None)
    code, out, _ = gate(capsys, folder)
    assert code == 2 and "evalkit gate: CANNOT JUDGE" in out, out
    assert f"prefilled from the same context {same!r}" in out, out


# --- the KL: a bound that holds --------------------------------------------------------------------------------


def kl_rows(kl: list[float]) -> list[dict]:
    """One-question contexts, scores all 1 (no loss), the variant's KL per row as given."""
    n = len(kl)
    return [
        {**r, "kl_mean": 0.0 if r["variant"] == "baseline" else kl[int(r["sample_id"])]} for r in rows([1] * n, [1] * n)
    ]


def heavy(n: int, share: float, at: float, mean: float) -> list[float]:
    """n rows: `share` of them at `at` nats, the rest equal, so that the mean is `mean`."""
    k = round(share * n)
    rest = (mean * n - k * at) / (n - k)
    return [at] * k + [rest] * (n - k)


def test_a_heavy_tail_at_the_limit_does_not_pass():
    # 3% of rows at 3 nats and the rest at 0.0103: the mean KL is 0.1, the limit. Each row capped at 1 nat, the
    # capped mean was 9 x 1 + 291 x 0.0103 = 12 over 300 = 0.04 nats: PASS. Capped at 3 nats nothing is cut.
    at_limit = heavy(300, 0.03, 3.0, 0.1)
    assert sum(at_limit) / 300 == pytest.approx(0.1)
    v = judge_rows(kl_rows(at_limit), [], Thresholds())
    assert v.status != "PASS", v.reasons
    # twice the limit (6% at 3 nats): capped at 1 nat its mean was 0.068 and PASSed; not now (the betting test's
    # FAIL is weak on so skewed a tail: INCONCLUSIVE), while twice the limit on every row is shown broken
    assert judge_rows(kl_rows(heavy(300, 0.06, 3.0, 0.2)), [], Thresholds()).status == "INCONCLUSIVE"
    twice = judge_rows(kl_rows([0.2] * 300), [], Thresholds())
    assert twice.status == "FAIL" and "mean KL at least" in "\n".join(twice.reasons)
    # 1% of rows at 10 nats and the rest at 0: the mean KL is 0.1, the limit, but capped at 3 nats it is 0.03, far
    # below it (a PASS by the capped mean alone): its share of rows above the cap, at max_kl_tail_share (0.01), is not
    # shown below it
    tail = [10.0] * 10 + [0.0] * 990
    assert sum(tail) / 1000 == pytest.approx(0.1)
    v = judge_rows(kl_rows(tail), [], Thresholds())
    assert v.status != "PASS" and "10 of 1000 KL rows above the 3-nat cap: their share may be" in "\n".join(v.reasons)
    # the control: a faithful variant (every row at 0.01 nats) PASSes from 378 documents (the tail share's count,
    # tests/test_gate_statistics.py)
    assert judge_rows(kl_rows([0.01] * 378), [], Thresholds()).status == "PASS"


def test_rows_above_the_cap_are_counted_and_reported(capsys, tmp_path):
    # 3 rows of 300 at 5 nats, above the 3-nat cap: verdict.json and the message name them (1.0% of the rows)
    from tests.test_gate import write_run

    folder = write_run(tmp_path / "tail", kl_rows(heavy(300, 0.01, 5.0, 0.1)))
    code, out, verdict = gate(capsys, folder)
    kl = verdict["variants"]["snapkv@0.25"]["gate"]["checks"]["kl"]
    assert (
        kl["cap"] == pytest.approx(3.0) and kl["rows_above_cap"] == 3 and kl["share_above_cap"] == pytest.approx(0.01)
    )
    assert "3 of 300 KL rows above the 3-nat cap: their share may be as large as" in out, out
    assert "3 rows above it (1.0%), judged by max_kl_tail_share" in out, out
    assert code == 2 and "evalkit gate: PASS" not in out
