"""lm-eval tasks run for every variant and, by replay, the baseline (task=lm_eval): each document a Job with its
Results for the run's sample loop (LmevalEngine), and lm-eval's results."""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lm_eval import simple_evaluate
from platformdirs import user_cache_dir

from evalkit.engine import models
from evalkit.engine.hf import HFEngine
from evalkit.engine.rows import hf_engine
from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant
from evalkit.lmeval.metrics import OWN_LENGTH, choose_metrics, doc_score
from evalkit.lmeval.model import EvalkitLM
from evalkit.modelspec import ModelSpec
from evalkit.records import BASELINE, SAMPLES, Job, Result, Row, read_rows, write_json
from evalkit.tasks.lmeval_index import task_manager

LM_EVAL_RESULTS = "lm_eval_results.json"  # lm-eval's own results of a run, beside its rows


def refuse_reconstruction(variants: list[Variant]) -> None:
    for variant in variants:
        if any(o.pass_name for o in variant.policy.needs()):  # a pass over the context, read with its prompt
            raise ConfigError(
                f"{variant.name}: task=lm_eval does not run KVzip's reconstruction pass (its requests are raw "
                "token ids, without the chat template and context boundary the repeat prompt is built from); "
                "use an evalkit task (needle, jsonl, ...)"
            )


def model_tokenizer(loaded: models.LoadedModel) -> str:
    """A name or folder AutoTokenizer loads the evaluated model's tokenizer from: RULER sizes its haystacks with it
    when task.metadata names none. A tokenizer built in memory (tiny-random) is saved once to evalkit's cache."""
    name = str(getattr(loaded.tokenizer, "name_or_path", "") or "")
    if name:
        return name
    out = Path(user_cache_dir("evalkit")) / "lmeval_tokenizers" / loaded.name
    if not (out / "tokenizer_config.json").exists():
        loaded.tokenizer.save_pretrained(out)
    return str(out)


def load_tasks(manager, names: list[str], seeds: dict | None = None) -> list:
    """Each named task, group or tag built once (RULER generates its documents here), to be handed to lm-eval as
    objects: the variant and the replayed baseline then run on the very same documents. RULER draws its needles
    from Python's global `random`: it is seeded first as lm-eval's simple_evaluate seeds it before it loads tasks
    (its random_seed, numpy_random_seed, torch_random_seed; `seeds` overrides them), so the documents are the ones
    `lm_eval --model hf` builds."""
    seeds = {k: v for k, v in (seeds or {}).items() if v is not None}
    random.seed(seeds.get("random_seed", 0))
    np.random.seed(seeds.get("numpy_random_seed", 1234))
    torch.manual_seed(seeds.get("torch_random_seed", 1234))
    out = []
    for name in names:
        built = manager.load([name])
        group = built["groups"].get(name)
        out.extend([group] if group is not None else built["tasks"].values())
    return out


def documents(
    runs: list[tuple[str, dict, dict]], kv_baseline: dict, baseline: dict, plan: dict[str, str | None]
) -> list[tuple[Job, list[Result]]]:
    """One Job per document with its Results from lm-eval's logged samples: the baseline's (replayed) and each
    variant's (runs: its name, the KV bytes noted per document, lm-eval's output), scored by the planned
    per-document metric (choose_metrics), with what each answered and the KV bytes of the document's compressed
    context."""
    out = []
    for task, docs in runs[0][2]["samples"].items():
        base = {d["doc_id"]: d for d in baseline["samples"][task]}
        logged = [(name, kv, {d["doc_id"]: d for d in run["samples"][task]}) for name, kv, run in runs]
        for d in docs:
            metric, _ = doc_score(task, d, plan)
            cell = {"lm_eval_task": task}
            if plan[task] is OWN_LENGTH:
                cell["max_length"] = int(d["doc"]["max_length"])
            sid = f"{task}/{d['doc_id']}"
            key = (task, d["doc_id"])
            row = {"sample_id": sid, "cell": cell, "metric": metric, "answers": d.get("target")}
            results = [_result(BASELINE, base[d["doc_id"]], task, plan, kv_baseline.get(key, {}))]
            results += [_result(name, by_id[d["doc_id"]], task, plan, kv.get(key, {})) for name, kv, by_id in logged]
            out.append((Job(sid, row), results))
    return out


def _result(name: str, doc: dict, task: str, plan: dict[str, str | None], kv: dict) -> Result:
    """What the model answered, as lm-eval logged it after its filters (the text of a generation, else the scores
    as `response`), scored by the planned metric."""
    _, score = doc_score(task, doc, plan)
    resps = doc.get("filtered_resps")
    if isinstance(resps, list) and len(resps) == 1 and isinstance(resps[0], str):
        return Result(name, resps[0], {**hf_engine(), **kv}, score)
    return Result(name, None, {"response": resps, **hf_engine(), **kv}, score)


class LmevalEngine(HFEngine):
    """lm-eval's driver as the sample loop's engine: the model loaded and the policies prepared as evalkit's own
    engine does, then lm-eval runs the requests and each document comes back as a Job with its Results, every
    `task.documents_per_call` documents (None: all in one call); lm-eval's own results go to lm_eval_results.json.
    A document whose rows the folder holds already for the baseline and every variant (a resumed run) is not run
    again. `lm_args`: EvalkitLM's settings (max_gen_toks, rolling_split); `seeds`: lm-eval's (load_tasks)."""

    @property
    def interruptible(self) -> bool:
        """Ctrl-C waits for the documents in flight when they come a call at a time (task.documents_per_call);
        one lm-eval call over every document is stopped at once (the rows written are whole all the same)."""
        return self.task.documents_per_call is not None

    def __init__(self, model: ModelSpec, device: str, task, variants: list[Variant], out_dir: Path, **settings):
        super().__init__(model, device, task, variants)
        self.out_dir = out_dir
        self.lm_args, self.seeds = settings.get("lm_args") or {}, settings.get("seeds")
        self.results: dict = {}  # lm_eval_results.json: lm-eval's results by variant (by call, when several)
        self.outputs: dict[str, dict] = {}  # lm-eval's whole output of the latest call, by variant
        self.done: frozenset[str] = frozenset()  # the documents (sample ids) the folder holds every row of

    def open(self, jobs: list[Job]) -> dict[str, Any]:
        """As evalkit's engine opens; the documents already done read from the folder's rows (the loop, which holds
        its lock, has cut a torn last row), and the results of the calls that wrote them."""
        self.done = complete(read_rows(self.out_dir / SAMPLES), [BASELINE, *self.variant_names()])
        previous = self.out_dir / LM_EVAL_RESULTS
        if self.done:
            print(f"evalkit: resuming {self.out_dir}: {len(self.done)} documents already done", file=sys.stderr)
            self.results = json.loads(previous.read_text()) if previous.exists() else {}
        return super().open(jobs)

    def run(self, jobs: list[Job]) -> Generator[tuple[Job, list[Result]]]:
        calls = evaluate(self.task, self.loaded, self.variants, self.lm_args, self.seeds, self.done)
        for answered, outputs in calls:
            results = {name: out["results"] for name, out in outputs.items()}
            self.results = {"calls": [*self.results.get("calls", [self.results]), results]} if self.results else results
            self.outputs = outputs
            write_json(self.out_dir / LM_EVAL_RESULTS, self.results)
            yield from answered


def complete(rows: list[Row], names: list[str]) -> frozenset[str]:
    """The sample ids `rows` hold a row of for each of `names` (the baseline and every variant)."""
    held: dict[str, set[str]] = {}
    for r in rows:
        held.setdefault(r.sample_id, set()).add(r.variant)
    return frozenset(sid for sid, variants in held.items() if variants.issuperset(names))


def evaluate(
    task,
    loaded: models.LoadedModel,
    variants: list[Variant],
    lm_args: dict | None = None,
    seeds: dict | None = None,
    done: frozenset[str] = frozenset(),
) -> Generator[tuple[list[tuple[Job, list[Result]]], dict]]:
    """Run lm-eval tasks for every variant from one prefill per context (EvalkitLM) and replay the baseline and the
    other variants; per call (calls), each document's Job and Results (documents) and lm-eval's output by
    variant; the documents `done` names (sample ids, `task/doc_id`) left out. `task.metadata` is lm-eval's task
    metadata (RULER's max_seq_lengths; its tokenizer, by default the model's). A variant lm-eval cannot run is
    refused at once, before any call."""
    refuse_reconstruction(variants)
    return _evaluate(task, loaded, variants, lm_args or {}, seeds, done)


def _evaluate(
    task, loaded: models.LoadedModel, variants: list[Variant], lm_args: dict, seeds: dict | None, done: frozenset[str]
) -> Generator[tuple[list[tuple[Job, list[Result]]], dict]]:
    metadata = task.lm_eval_metadata()
    if "tokenizer" not in metadata and "pretrained" not in metadata:
        metadata["tokenizer"] = model_tokenizer(loaded)
    manager = task_manager(list(task.tasks), metadata, task.include_paths())
    objects = load_tasks(manager, list(task.tasks), seeds)
    plan = choose_metrics(manager.load(objects)["tasks"], task.metric)
    fixed = {"task_manager": manager, "num_fewshot": task.num_fewshot, "bootstrap_iters": 0, "log_samples": True}
    fixed |= {"gen_kwargs": task.lm_eval_gen_kwargs(), **{k: v for k, v in (seeds or {}).items() if v is not None}}
    lm = EvalkitLM(loaded, variants, **lm_args)
    names = [v.name for v in variants]
    for call in calls(manager, objects, task.limit, task.documents_per_call, done):
        for store in lm.kv_of.values():
            store.clear()  # a call's KV bytes are its own documents'
        runs = [simple_evaluate(model=lm, **fixed, **call)]  # every variant answers here, from one prefill
        runs += [simple_evaluate(model=lm.replay(name), **fixed, **call) for name in names[1:]]
        baseline = simple_evaluate(model=lm.baseline(), **fixed, **call)
        runs_kv = [(n, by_document(lm.kv_of[n], call), r) for n, r in zip(names, runs, strict=True)]
        answered = documents(runs_kv, by_document(lm.kv_of[BASELINE], call), baseline, plan)
        yield answered, {BASELINE: baseline, **dict(zip(names, runs, strict=True))}


def by_document(noted: dict, call: dict) -> dict:
    """The KV bytes noted per (task, request's doc_id), by (task, document id): lm-eval numbers the requests of a
    call that names its documents (`samples`) by their place among them, and logs each document's own id."""
    samples = call.get("samples")
    if not samples:
        return noted
    return {(task, samples[task][place]): fields for (task, place), fields in noted.items()}


def calls(manager, objects: list, limit: float | None, per_call: int | None, done: frozenset[str] = frozenset()):
    """What each lm-eval call runs: every task whole (`limit` documents of each), or each task's documents
    `per_call` at a time (lm-eval's `samples`), so that a run's rows are written as its documents finish. The
    documents `done` names (`task/doc_id`: a resumed run's) are left out, and a call left with none is not made."""
    if per_call is None and not done:
        return [{"tasks": objects, "limit": limit}]
    todo = {}
    for name, leaf in manager.load(objects)["tasks"].items():
        n = len(leaf.eval_docs)
        count = n if limit is None else min(n, math.ceil(n * limit) if limit < 1.0 else int(limit))
        todo[name] = (leaf, [i for i in range(count) if f"{name}/{i}" not in done])
    if per_call is None:  # the documents left, in one call
        left = {name: (leaf, ids) for name, (leaf, ids) in todo.items() if ids}
        if not left:
            return []
        return [{"tasks": [leaf for leaf, _ in left.values()], "samples": {k: ids for k, (_, ids) in left.items()}}]
    return [
        {"tasks": [leaf], "samples": {name: ids[i : i + per_call]}}
        for name, (leaf, ids) in todo.items()
        for i in range(0, len(ids), per_call)
    ]
