"""lm-eval integration on the tiny random model with the bundled offline task."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="pip install 'lm-eval>=0.4.9,<0.5' for the lm-eval integration")

from omegaconf import OmegaConf  # noqa: E402

from evalkit.cli.config import variants as parse_variants  # noqa: E402
from evalkit.engine import engine as engine_module  # noqa: E402
from evalkit.engine import outcome as outcome_module  # noqa: E402
from evalkit.engine.engine import run_sample  # noqa: E402
from evalkit.kv.cache import held_per_layer  # noqa: E402
from evalkit.kv.variant import Variant  # noqa: E402
from evalkit.lmeval import evaluate as lm_evaluate  # noqa: E402
from evalkit.lmeval import metrics as lm_metrics  # noqa: E402
from evalkit.lmeval import model as lm_model  # noqa: E402
from evalkit.records import BASELINE, read_rows  # noqa: E402
from evalkit.tasks import lmeval_index  # noqa: E402
from evalkit.tasks.lmeval_index import task_manager  # noqa: E402
from evalkit.tasks.prompt import Prompt  # noqa: E402
from tests.conftest import ROOT, run_cli  # noqa: E402


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def request(args, doc_id=0):
    return SimpleNamespace(args=args, task_name="t", doc_id=doc_id)


def lm_for(tiny, variant):
    (parsed,) = parse_variants(OmegaConf.create({"seed": 0, "variants": [variant]}))
    return lm_model.EvalkitLM(tiny, parsed)


# The tiny model (conf/model/tiny-random.yaml): its KV bytes are counted here by hand, not by evalkit.kv.cache.
LAYERS, KV_HEADS, HEAD_DIM, FLOAT32 = 3, 2, 16, 4


def kv_by_hand(tokens: int) -> int:
    """Bytes of the keys and values of `tokens` tokens in every layer of the tiny model."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * tokens * FLOAT32


def test_kv_by_hand_describes_the_tiny_model(tiny):
    c = tiny.model.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    assert tiny.model.dtype == torch.float32


def engine_loglikelihoods(tiny, variant, context: str, continuation: str) -> tuple[float, float]:
    """(variant, baseline) log-likelihood of continuation after context by the engine's own teacher-forced run of a
    sample: the context but its last token prefilled and compressed, the rest fed one token at a time."""
    ctx = tiny.tokenizer(context).input_ids
    whole = tiny.tokenizer(context + continuation).input_ids
    assert whole[: len(ctx)] == ctx
    prompt = Prompt(torch.tensor([whole]), len(ctx) - 1, [], "query_agnostic")
    base, (out,) = run_sample(tiny.model, prompt, [variant], 0, set(), forced=True)
    targets = torch.tensor(whole[len(ctx) :])
    lp = [float(torch.stack(o.logits).log_softmax(-1).gather(1, targets[:, None]).sum()) for o in (out, base)]
    return lp[0], lp[1]


def streaming_by_mask(tiny, context: str, continuation: str, sinks: int, budget: int) -> float:
    """StreamingLLM's log-likelihood of continuation written out as one forward of the full model under a mask: the
    context (but its last token) is prefilled with full causal attention; every later token q then sees only what
    a cache evicting to `budget` after every step holds when q goes through: the first `sinks` tokens and the
    budget - sinks most recent tokens before q, and q itself."""
    ctx = tiny.tokenizer(context).input_ids
    whole = tiny.tokenizer(context + continuation).input_ids
    n, size = len(ctx) - 1, len(whole)
    seen = torch.zeros(size, size, dtype=torch.bool)
    for q in range(size):
        if q < n:
            seen[q, : q + 1] = True
        else:
            seen[q, :sinks] = True
            seen[q, max(sinks, q - (budget - sinks)) : q + 1] = True
    mask = torch.zeros(1, 1, size, size).masked_fill(~seen, float("-inf"))
    with torch.inference_mode():
        lp = tiny.model(input_ids=torch.tensor([whole]), attention_mask=mask).logits[0].float().log_softmax(-1)
    return sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), size))


def capture_caches(monkeypatch) -> list:
    """The caches the adapter teacher-forces on, in order (baseline, then variant, per request), as the engine's one
    decode path (evalkit.engine.outcome) hands them to the one decode loop, decode_lanes, with forced=True."""
    caches = []
    real = outcome_module.decode_lanes

    def spy(model, lanes, *a, **k):
        if k.get("forced"):
            caches.extend(lane.cache for lane in lanes)
        return real(model, lanes, *a, **k)

    monkeypatch.setattr(outcome_module, "decode_lanes", spy)
    return caches


CONTEXT, CONTINUATION = "word " * 40 + "end", " and then a long continuation goes on and on"  # 203 and 44 tokens


def test_loglikelihood_evicts_while_scoring_as_the_engine_does(tiny, monkeypatch):
    budget = 16
    lm = lm_for(tiny, f"streaming_llm@{budget}")
    assert lm.variant.policy.decode and len(tiny.tokenizer(CONTINUATION).input_ids) > 1
    caches = capture_caches(monkeypatch)
    ((got, _),) = lm.loglikelihood([request((CONTEXT, CONTINUATION))])
    evicting, baseline = engine_loglikelihoods(tiny, lm.variant, CONTEXT, CONTINUATION)
    kept = engine_loglikelihoods(
        tiny, Variant(dataclasses.replace(lm.variant.policy, decode=False)), CONTEXT, CONTINUATION
    )[0]
    assert got == pytest.approx(evicting, abs=1e-4)
    assert got == pytest.approx(
        streaming_by_mask(tiny, CONTEXT, CONTINUATION, lm.variant.policy.n_sink, budget), abs=1e-3
    )
    assert abs(got - kept) > 0.05  # the continuation outgrows the budget: not evicting would score it otherwise
    assert lm.answers[BASELINE][lm_model._key("loglikelihood", (CONTEXT, CONTINUATION))][0] == pytest.approx(
        baseline, abs=1e-4
    )
    # after scoring, every layer of the variant holds its budget; the baseline holds every token it was fed
    n_fed = len(tiny.tokenizer(CONTEXT + CONTINUATION).input_ids) - 1
    baseline_cache, variant_cache = caches[:2]  # the adapter's (the engine's own runs below add theirs)
    assert held_per_layer(variant_cache) == [budget] * LAYERS
    assert held_per_layer(baseline_cache) == [n_fed] * LAYERS
    record = lm.kv_of[lm.variant.name][("t", 0)]
    assert record["kv_bytes_final"] == kv_by_hand(budget) and record["tokens_held_per_layer"] == [budget] * LAYERS


def test_loglikelihood_records_the_full_prefill_as_the_peak_not_the_compressed_bytes(tiny):
    lm = lm_for(tiny, "streaming_llm@16")
    lm.loglikelihood([request((CONTEXT, CONTINUATION))])
    n_context = len(tiny.tokenizer(CONTEXT).input_ids) - 1  # the last context token is fed with the continuation
    n_fed = len(tiny.tokenizer(CONTEXT + CONTINUATION).input_ids) - 1
    record = lm.kv_of[lm.variant.name][("t", 0)]
    assert record["kv_bytes"] == kv_by_hand(16) and record["kv_bytes_baseline"] == kv_by_hand(n_context)
    assert record.get("peak_kv_bytes") == kv_by_hand(n_context)  # the full cache, not the 16 tokens compressed
    assert record["prefill_peak_kv_bytes"] == kv_by_hand(n_context)
    base = lm.kv_of[BASELINE][("t", 0)]
    assert base["kv_bytes"] == kv_by_hand(n_context)
    assert base["peak_kv_bytes"] == base["kv_bytes_final"] == kv_by_hand(n_fed)
    # an lm-eval document is one row: its document is what it prefilled, the same for the baseline and the variant
    assert record["document_id"] == record["context_id"] == base["document_id"]


def test_the_peak_counts_every_step_before_its_eviction(tiny):
    # a context shorter than the budget: the prefill holds 10 tokens, each step 17 before it evicts back to 16
    lm = lm_for(tiny, "streaming_llm@16")
    context = "abcdefghijk"
    lm.loglikelihood([request((context, CONTINUATION))])
    assert len(tiny.tokenizer(context).input_ids) - 1 == 10
    record = lm.kv_of[lm.variant.name][("t", 0)]
    assert record["kv_bytes"] == record["prefill_peak_kv_bytes"] == kv_by_hand(10)
    assert record["peak_kv_bytes"] == kv_by_hand(17) and record["kv_bytes_final"] == kv_by_hand(16)
    # a policy that compresses once: the continuation grows the cache past the context it was prefilled from
    lm = lm_for(tiny, "knorm@0.5")
    lm.loglikelihood([request((context, CONTINUATION))])
    n_cont = len(tiny.tokenizer(context + CONTINUATION).input_ids) - len(tiny.tokenizer(context).input_ids)
    record = lm.kv_of[lm.variant.name][("t", 0)]
    assert record["kv_bytes"] == kv_by_hand(5)
    assert record["peak_kv_bytes"] == record["kv_bytes_final"] == kv_by_hand(5 + n_cont) > kv_by_hand(10)


def test_loglikelihood_prefills_a_chunked_variant_in_chunks(tiny, monkeypatch):
    calls = []
    real = engine_module.prefill
    monkeypatch.setattr(engine_module, "prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = lm_for(tiny, "streaming_llm@16:chunk8")
    ((got, _),) = lm.loglikelihood([request((CONTEXT, CONTINUATION))])
    assert len(calls) == 1  # the baseline's full prefill; the variant never holds the full cache
    assert got == pytest.approx(engine_loglikelihoods(tiny, lm.variant, CONTEXT, CONTINUATION)[0], abs=1e-4)
    record = lm.kv_of[lm.variant.name][("t", 0)]
    # chunks of 8 onto a cache evicted to 16: at most 24 tokens, while the continuation holds 17 at most
    assert record["prefill"] == {"mode": "chunked", "chunk": 8} and record["prefill_peak_tokens"] == 24
    assert record["peak_kv_bytes"] == record["prefill_peak_kv_bytes"] == kv_by_hand(24)
    assert record["prefill_bound_tokens"] == 24 and record["kv_bytes_final"] == kv_by_hand(16)


def test_rolling_and_generate_until_record_the_true_peak(tiny, monkeypatch):
    lm = lm_for(tiny, "streaming_llm@16")
    caches = capture_caches(monkeypatch)
    text = "some text " * 20
    lm.loglikelihood_rolling([request((text,))])
    ids = [tiny.tokenizer.bos_token_id or tiny.tokenizer.eos_token_id] + tiny.tokenizer(text).input_ids
    split = int(len(ids) * lm.rolling_split)
    record = lm.kv_of[lm.variant.name][("t", 0)]
    assert record["context_tokens"] == split - 1
    assert record["peak_kv_bytes"] == kv_by_hand(split - 1) and record["kv_bytes_final"] == kv_by_hand(16)
    assert held_per_layer(caches[1]) == [16] * LAYERS and held_per_layer(caches[0]) == [len(ids) - 1] * LAYERS
    assert lm.kv_of[BASELINE][("t", 0)]["peak_kv_bytes"] == kv_by_hand(len(ids) - 1)

    lm.generate_until([request(("word " * 40, {"until": ["\n"], "max_gen_toks": 5}), doc_id=1)])
    n_context = len(tiny.tokenizer("word " * 40).input_ids) - 1
    record, base = lm.kv_of[lm.variant.name][("t", 1)], lm.kv_of[BASELINE][("t", 1)]
    assert record["kv_bytes"] == kv_by_hand(16) and record["peak_kv_bytes"] == kv_by_hand(n_context)
    assert kv_by_hand(n_context) < base["peak_kv_bytes"] <= kv_by_hand(n_context + 5)


def test_loglikelihood_equals_the_full_model_at_full_budget(tiny):
    lm = lm_for(tiny, "snapkv@1.0")
    context, continuation = "The cat sat on the", " mat today"
    (got,) = lm.loglikelihood([request((context, continuation))])
    ctx = tiny.tokenizer(context).input_ids
    whole = tiny.tokenizer(context + continuation).input_ids
    with torch.inference_mode():
        logp = tiny.model(torch.tensor([whole])).logits[0].log_softmax(-1)
    want = sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole)))
    assert got[0] == pytest.approx(want, abs=1e-4)
    assert lm.answers[BASELINE][lm_model._key("loglikelihood", (context, continuation))][0] == pytest.approx(
        want, abs=1e-4
    )


def test_one_compressed_context_serves_every_choice(tiny, monkeypatch):
    calls = []
    real = engine_module.prefill
    monkeypatch.setattr(engine_module, "prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = lm_for(tiny, "knorm@0.5")
    context = "word " * 60
    out = lm.loglikelihood([request((context, f" choice {c}")) for c in "abcd"])
    assert len(out) == 4 and len(calls) == 1
    assert lm.kv_of[lm.variant.name][("t", 0)]["kv_bytes"] < lm.kv_of[lm.variant.name][("t", 0)]["kv_bytes_baseline"]


def test_generate_until_and_rolling_run_baseline_beside_the_variant(tiny):
    lm = lm_for(tiny, "streaming_llm@16")
    (text,) = lm.generate_until([request(("word " * 40, {"until": ["\n"], "max_gen_toks": 5}))])
    assert isinstance(text, str) and "\n" not in text
    (total,) = lm.loglikelihood_rolling([request(("some text " * 20,))])
    base = lm.answers[BASELINE][lm_model._key("loglikelihood_rolling", ("some text " * 20,))]
    assert total < 0 and base < 0 and total != base
    replay = lm.baseline()
    assert replay.loglikelihood_rolling([request(("some text " * 20,))]) == [base]


def test_simple_evaluate_scores_variant_and_replayed_baseline(tiny):
    from lm_eval import simple_evaluate

    lm = lm_for(tiny, "none@1.0")
    kwargs = {
        "tasks": ["evalkit_recall"],
        "task_manager": task_manager(["evalkit_recall"]),
        "limit": 3,
        "bootstrap_iters": 0,
    }
    run = simple_evaluate(model=lm, **kwargs)
    base = simple_evaluate(model=lm.baseline(), **kwargs)
    assert run["results"]["evalkit_recall"]["acc,none"] == base["results"]["evalkit_recall"]["acc,none"]
    assert [d["resps"] for d in run["samples"]["evalkit_recall"]] == [
        d["resps"] for d in base["samples"]["evalkit_recall"]
    ]


def test_evalkit_cli_runs_lm_eval_tasks_with_one_row_per_document(tmp_path):
    result = run_cli(
        "model=tiny-random",
        "task=lm_eval",
        "task.limit=3",
        "variants=[snapkv@0.5]",
        f"hydra.run.dir={tmp_path}",
        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_rows(tmp_path / "samples.jsonl")
    assert sorted((r["sample_id"], r["variant"]) for r in rows) == sorted(
        (f"evalkit_recall/{i}", v) for i in range(3) for v in ("baseline", "snapkv@0.5")
    )
    assert all(r["metric"] == "acc" and r["kv_bytes"] for r in rows)
    # the peak is what was really held: the full cache during the prefill, and more while the baseline scores
    for r in rows:
        if r["variant"] == "baseline":
            assert r["kv_bytes"] == r["kv_bytes_baseline"] < r["peak_kv_bytes"]
        else:
            assert r["kv_bytes"] < r["kv_bytes_baseline"] <= r["peak_kv_bytes"]
        assert r["prefill_peak_kv_bytes"] == r["kv_bytes_baseline"]
    results = json.loads((tmp_path / "lm_eval_results.json").read_text())
    assert set(results) == {"baseline", "snapkv@0.5"}


def lm_eval_command(cwd, model_args: str, *args: str, subcommand: tuple[str, ...] = ()):
    """lm-eval's command line through evalkit (`python -m evalkit.lmeval [SUBCOMMAND] --model evalkit --model_args
    MODEL_ARGS ARGS`), offline, in a process of its own as a user runs it."""
    argv = [sys.executable, "-m", "evalkit.lmeval", *subcommand, "--model", "evalkit", "--model_args", model_args]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*argv, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def test_lm_eval_command_line_knows_the_evalkit_model_and_writes_paired_records(tmp_path):
    """lm-eval's own command line with --model evalkit writes the Hydra route's paired records: a baseline and a
    variant row per document, scored as lm-eval logged the variant's documents itself (--log_samples), with flips
    that follow from the two scores, and summary.json. A route that threw the baseline away writes none of them."""
    out = lm_eval_command(
        tmp_path,
        f"model=tiny-random,variant=snapkv@0.5,records={tmp_path / 'records'}",
        "--tasks",
        "evalkit_recall",
        "--limit",
        "3",
        "--log_samples",
        "--output_path",
        str(tmp_path / "lm_eval"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "evalkit_recall" in out.stdout and "acc" in out.stdout
    rows = read_rows(tmp_path / "records" / "samples.jsonl")
    assert sorted((r["sample_id"], r["variant"]) for r in rows) == sorted(
        (f"evalkit_recall/{i}", v) for i in range(3) for v in ("baseline", "snapkv@0.5")
    )
    (logged,) = (tmp_path / "lm_eval").rglob("samples_evalkit_recall_*.jsonl")
    acc = {json.loads(line)["doc_id"]: json.loads(line)["acc"] for line in logged.read_text().splitlines()}
    variant = {r["sample_id"]: r for r in rows if r["variant"] == "snapkv@0.5"}
    baseline = {r["sample_id"]: r for r in rows if r["variant"] == "baseline"}
    for i in range(3):
        v, b = variant[f"evalkit_recall/{i}"], baseline[f"evalkit_recall/{i}"]
        assert v["score"] == acc[i] and v["baseline_score"] == b["score"] == b["baseline_score"]
        want = None if v["score"] == b["score"] else ("lost" if v["score"] < b["score"] else "gained")
        assert v["flip"] == want and b["flip"] is None
        assert v["kv_bytes"] < b["kv_bytes"]
    summary = json.loads((tmp_path / "records" / "summary.json").read_text())
    assert summary and (tmp_path / "records" / "run.json").exists()


def test_unknown_lm_eval_task_is_a_config_error(tmp_path):
    result = run_cli(
        "model=hf",
        "model.name_or_path=/nonexistent",
        "model.max_context=4096",
        "task=lm_eval",
        "task.tasks=[evalkit_recal]",
        f"hydra.run.dir={tmp_path}",
        env={"HF_DATASETS_OFFLINE": "1"},
    )
    assert result.returncode == 2
    assert "lm-eval knows no task 'evalkit_recal'; did you mean evalkit_recall" in result.stderr


def test_lm_eval_command_line_keeps_the_exit_code_contract():
    result = lm_eval_command(ROOT, "model=tiny-random", "--tasks", "no_such_task_xyz", subcommand=("run",))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "evalkit: error: lm-eval: Tasks not found: no_such_task_xyz"


# -- lm-eval's long-context suites with paired records ----------------------------------------------------------------

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from evalkit.errors import ConfigError  # noqa: E402
from evalkit.records import flip, pair  # noqa: E402

LM_EVAL_TASKS = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")


class Scripted(LM):
    """An lm-eval model whose generations are given per request: answers(request) -> text (the request names its
    task, document and doc_id)."""

    def __init__(self, answers):
        super().__init__()
        self.answers = answers

    def generate_until(self, requests, disable_tqdm: bool = False):
        return [self.answers(r) for r in requests]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


@pytest.fixture(scope="module")
def ruler_512(tiny):
    """lm-eval's own niah_single_1 (the repeat haystack, built offline) at 512 tokens of the tiny model's
    tokenizer, as the Hydra route loads it: task.metadata passed to lm-eval, the model's tokenizer by default."""
    manager = TaskManager(
        include_defaults=False,
        include_path=os.path.join(LM_EVAL_TASKS, "ruler"),
        metadata={"max_seq_lengths": [512], "tokenizer": lm_evaluate.model_tokenizer(tiny)},
    )
    return manager, lm_evaluate.load_tasks(manager, ["niah_single_1"])


def paired_by_hand(manager, objects, variant_answers, baseline_answers, limit, metric=None):
    """lm-eval runs the tasks with the scripted variant and baseline, evalkit pairs the logged documents."""
    from lm_eval import simple_evaluate

    kwargs = {"tasks": objects, "task_manager": manager, "limit": limit, "log_samples": True, "bootstrap_iters": 0}
    run = simple_evaluate(model=Scripted(variant_answers), **kwargs)
    base = simple_evaluate(model=Scripted(baseline_answers), **kwargs)
    plan = lm_metrics.choose_metrics(manager.load(objects)["tasks"], metric)
    head = {"run_id": "by-hand", "task": "lm_eval", "protocol": "query_agnostic"}
    answered = lm_evaluate.documents([("v", {}, run)], {}, base, plan)
    return [row.to_dict() for job, results in answered for row in pair(head, job.row, results)]


def test_ruler_rows_score_the_document_length_not_the_placeholder(ruler_512):
    """RULER logs -1 under every length a document was not generated at ("4096", its default, comes first): a
    record that took the first numeric metric scores every row -1 and sees no flip. By hand: the variant names the
    needle of documents 0 and 2, the baseline of 0, 1 and 2, so document 1 is the one lost."""
    manager, objects = ruler_512
    needle = lambda ids: lambda r: f"The number is {r.doc['outputs'][0]}." if r.doc_id in ids else "I do not know."  # noqa: E731
    rows = paired_by_hand(manager, objects, needle({0, 2}), needle({0, 1, 2}), limit=4)
    variant = {r["sample_id"]: r for r in rows if r["variant"] == "v"}
    baseline = {r["sample_id"]: r for r in rows if r["variant"] == "baseline"}
    ids = [f"niah_single_1/{i}" for i in range(4)]
    assert [variant[i]["score"] for i in ids] == [1.0, 0.0, 1.0, 0.0]
    assert [baseline[i]["score"] for i in ids] == [1.0, 1.0, 1.0, 0.0]
    assert [variant[i]["baseline_score"] for i in ids] == [1.0, 1.0, 1.0, 0.0]
    assert [flip(variant[i]["score"], variant[i]["baseline_score"]) for i in ids] == [None, "lost", None, None]
    assert {r["metric"] for r in rows} == {"512"} and {r["cell"]["max_length"] for r in rows} == {512}
    assert variant["niah_single_1/1"]["prediction"] == "I do not know."


def test_ruler_refuses_a_metric_that_is_a_placeholder(ruler_512):
    """task.metric naming a length the documents were not generated at would score RULER's -1 placeholder."""
    manager, objects = ruler_512
    tasks = manager.load(objects)["tasks"]
    with pytest.raises(ConfigError, match="RULER scores each document under its own length.*-1"):
        lm_metrics.choose_metrics(tasks, "4096")
    assert lm_metrics.choose_metrics(tasks, "512") == lm_metrics.choose_metrics(tasks, None) == {"niah_single_1": None}


TWO_METRICS = """
task: two_metrics
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def test_a_task_with_several_metrics_is_refused_unless_one_is_chosen(tmp_path):
    """acc and acc_norm can disagree on a document: evalkit must not pick one silently (ConfigError, exit 2, one
    line); task.metric chooses, and a metric the task does not log is refused."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "2+2=", "choices": ["4", "5"], "label": 0}) + "\n")
    (tmp_path / "two_metrics.yaml").write_text(TWO_METRICS.format(data=json.dumps(str(data))))
    manager = TaskManager(include_defaults=False, include_path=str(tmp_path))
    tasks = manager.load(lm_evaluate.load_tasks(manager, ["two_metrics"]))["tasks"]
    with pytest.raises(ConfigError, match=r"several per-document metrics \(acc, acc_norm\).*task.metric=acc"):
        lm_metrics.choose_metrics(tasks, None)
    assert lm_metrics.choose_metrics(tasks, "acc_norm") == {"two_metrics": "acc_norm"}
    assert lm_metrics.choose_metrics(tasks, {"two_metrics": "acc"}) == {"two_metrics": "acc"}
    with pytest.raises(ConfigError, match="logs acc, acc_norm per document"):
        lm_metrics.choose_metrics(tasks, "f1")
    with pytest.raises(ConfigError, match="not among the tasks run"):
        lm_metrics.choose_metrics(tasks, {"hellaswag": "acc"})
    result = lm_eval_command(tmp_path, "model=tiny-random", "--tasks", "two_metrics", "--include_path", str(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("evalkit: error: lm-eval task 'two_metrics' logs several per-document metrics")


LONGBENCH_TASK = """
task: longbench_local_{name}
include: {path}
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
"""
LONGBENCH_GROUP = """
group: longbench_local
task: [longbench_local_hotpotqa, longbench_local_passage_count]
aggregate_metric_list:
  - metric: score
    weight_by_size: false
"""


def test_a_longbench_group_scores_each_task_by_its_unified_score(tmp_path):
    """lm-eval's LongBench tasks (here two of a group, on local rows: the real data lives on the Hub) log `score`
    beside their own metric; the default is `score`. By hand, answer "Paris": the prediction "in Paris France" has
    token F1 2*(1/3*1)/(1/3+1) = 0.5 (hotpotqa's qa_f1); for passage_count, answer "3", the prediction "2 or 3"
    scores 1 of its 2 numbers = 0.5 (count_score); "Paris" and "3" score 1."""
    data = tmp_path / "rows.jsonl"
    row = {
        "question": "Where?",
        "context": "Paris is in France.",
        "answers": ["Paris"],
        "length": 4,
        "dataset": "x",
        "language": "en",
        "all_classes": None,
        "_id": "0",
    }
    data.write_text(json.dumps(row) + "\n" + json.dumps({**row, "answers": ["3"], "_id": "1"}) + "\n")
    for name in ("hotpotqa", "passage_count"):
        path = os.path.join(LM_EVAL_TASKS, "longbench", f"{name}.yaml")
        text = LONGBENCH_TASK.format(name=name, path=json.dumps(path), data=json.dumps(str(data)))
        (tmp_path / f"{name}.yaml").write_text(text)
    (tmp_path / "group.yaml").write_text(LONGBENCH_GROUP)
    manager = TaskManager(include_defaults=False, include_path=str(tmp_path))
    objects = lm_evaluate.load_tasks(manager, ["longbench_local"])
    variant = {"longbench_local_hotpotqa": "in Paris France", "longbench_local_passage_count": "2 or 3"}
    baseline = {"longbench_local_hotpotqa": "Paris", "longbench_local_passage_count": "3"}
    tasks = manager.load(objects)["tasks"]
    assert lm_metrics.choose_metrics(tasks, None) == {t: "score" for t in variant}
    rows = paired_by_hand(manager, objects, lambda r: variant[r.task_name], lambda r: baseline[r.task_name], 2)
    got = {(r["cell"]["lm_eval_task"], r["sample_id"].rsplit("/")[1], r["variant"]): r["score"] for r in rows}
    assert got[("longbench_local_hotpotqa", "0", "v")] == pytest.approx(0.5)
    assert got[("longbench_local_hotpotqa", "0", "baseline")] == 1.0
    assert got[("longbench_local_passage_count", "1", "v")] == pytest.approx(0.5)
    assert got[("longbench_local_passage_count", "1", "baseline")] == 1.0
    assert all(r["metric"] == "score" for r in rows)


def test_ruler_documents_are_the_ones_lm_eval_builds(ruler_512):
    """RULER draws its needles from Python's global random: evalkit loads the tasks itself (once, for the variant
    and the replayed baseline), so it must seed as lm-eval's simple_evaluate does before loading (random.seed(0)),
    or each process builds other documents than `lm_eval --model hf` (a route whose prompts differ from hf's)."""
    import random

    manager, _ = ruler_512
    random.seed(12345)  # whatever state an earlier import or run left
    (ours,) = lm_evaluate.load_tasks(manager, ["niah_single_1"])
    random.seed(0)  # lm-eval's default random_seed, set in simple_evaluate before task_manager.load
    stock = manager.load(["niah_single_1"])["tasks"]["niah_single_1"]
    assert [d["outputs"] for d in ours.eval_docs][:20] == [d["outputs"] for d in stock.eval_docs][:20]
    assert [d["input"] for d in ours.eval_docs][:5] == [d["input"] for d in stock.eval_docs][:5]


# --- the task index: only the folders a name needs --------------------------------------------------------------


def _entry(kind: str, tags=(), task=None):
    return SimpleNamespace(
        kind=SimpleNamespace(name=kind), tags=set(tags), cfg=None if task is None else {"task": task}
    )


def test_each_name_needs_its_first_definitions_folder_and_its_members_by_hand():
    """Four folders in lm-eval's order: a task defined twice is a's (lm-eval keeps the first); a group needs its
    members' folders; a tag set in two folders, or a group reaching a name defined in two of its folders, needs the
    full index (None), since lm-eval indexing folders apart lets a later folder's definition win."""
    indexes = {
        "a": {
            "t1": _entry("TASK", ["x"]),
            "x": _entry("TAG", ["t1"]),
            "g1": _entry("GROUP", task=["t1", {"task": "t3"}]),
        },
        "b": {"t2": _entry("TASK", ["x"]), "x": _entry("TAG", ["t2"]), "t4": _entry("TASK")},
        "c": {"t3": _entry("TASK"), "t1": _entry("TASK"), "g2": _entry("GROUP", task=["t4"])},
        "d": {"g3": _entry("GROUP", task=["g2", "nowhere"])},
    }
    assert lmeval_index.folders_needed(indexes) == {
        "t1": ["a"], "t2": ["b"], "t3": ["c"], "t4": ["b"],
        "g1": None,  # t1 (a's) and t3 (c's): c defines t1 too
        "x": None,  # the tag is set in a and in b
        "g2": ["b", "c"],
        "g3": ["b", "c", "d"],
    }  # fmt: skip


def test_a_run_indexes_only_what_its_tasks_need_and_finds_what_the_full_index_finds():
    """For a task (RULER's niah_single_1), a group of groups (mmlu) and a group over seven folders (openllm), the
    run's task manager holds each name, and every name it reaches, from the same file and of the same kind as
    lm-eval's full index; it reads a fraction of the files."""
    from lm_eval.tasks import TaskManager

    full = TaskManager().task_index
    for name in ("niah_single_1", "mmlu", "openllm"):
        index = lmeval_index.task_manager([name]).task_index
        assert len(index) < len(full) / 10
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            want, got = full[n], index.get(n)
            assert got is not None and (got.kind, got.yaml_path, got.tags) == (want.kind, want.yaml_path, want.tags), n
            kind = want.kind.name
            listed = (want.cfg or {}).get("task") if kind == "GROUP" else sorted(want.tags) if kind == "TAG" else []
            todo += [m if isinstance(m, str) else m["task"] for m in listed or [] if isinstance(m, (str, dict))]
        assert len(seen) > (1 if name != "niah_single_1" else 0)
