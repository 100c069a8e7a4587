"""lm-eval tasks run for every variant and, by replay, the baseline (task=lm_eval): each document a Job with its
Results for the run's sample loop (LmevalEngine), and lm-eval's results."""

from __future__ import annotations

import random
from collections.abc import Generator
from pathlib import Path

import numpy as np
import torch
from platformdirs import user_cache_dir

from evalkit.engine import models
from evalkit.engine.hf import HFEngine
from evalkit.engine.rows import hf_engine
from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant
from evalkit.lmeval.metrics import OWN_LENGTH, choose_metrics, doc_score
from evalkit.lmeval.model import EvalkitLM
from evalkit.modelspec import ModelSpec
from evalkit.records import BASELINE, Job, Result, write_json
from evalkit.tasks.lmeval_index import task_manager


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
    runs: list[tuple[EvalkitLM, dict]], baseline: dict, plan: dict[str, str | None]
) -> list[tuple[Job, list[Result]]]:
    """One Job per document with its Results from lm-eval's logged samples: the baseline's (replayed beside the
    first variant) and each variant's, scored by the planned per-document metric (choose_metrics), with what each
    answered and the KV bytes of the document's compressed context."""
    (first, first_run), out = runs[0], []
    for task, docs in first_run["samples"].items():
        base = {d["doc_id"]: d for d in baseline["samples"][task]}
        logged = [(lm, {d["doc_id"]: d for d in run["samples"][task]}) for lm, run in runs]
        for d in docs:
            metric, _ = doc_score(task, d, plan)
            cell = {"lm_eval_task": task}
            if plan[task] is OWN_LENGTH:
                cell["max_length"] = int(d["doc"]["max_length"])
            sid = f"{task}/{d['doc_id']}"
            key = (task, d["doc_id"])
            row = {"sample_id": sid, "cell": cell, "metric": metric, "answers": d.get("target")}
            results = [_result(BASELINE, base[d["doc_id"]], task, plan, first.kv_baseline.get(key, {}))]
            results += [
                _result(lm.variant.name, by_id[d["doc_id"]], task, plan, lm.kv.get(key, {})) for lm, by_id in logged
            ]
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
    engine does, then lm-eval runs every request in one call and each document comes back as a Job with its
    Results; lm-eval's own results go to lm_eval_results.json."""

    interruptible = False  # lm-eval runs every request in one call: Ctrl-C stops it at once

    def __init__(self, model: ModelSpec, device: str, task, variants: list[Variant], out_dir: Path):
        super().__init__(model, device, task, variants)
        self.out_dir = out_dir

    def run(self, jobs: list[Job]) -> Generator[tuple[Job, list[Result]]]:
        answered, results = evaluate(self.task, self.loaded, self.variants)
        write_json(self.out_dir / "lm_eval_results.json", results)
        yield from answered


def evaluate(task, loaded: models.LoadedModel, variants: list[Variant]) -> tuple[list[tuple[Job, list[Result]]], dict]:
    """Run lm-eval tasks for every variant and, by replay, the baseline; each document's Job and Results
    (documents) and lm-eval's results. `task.metadata` is lm-eval's task metadata (RULER's max_seq_lengths; its
    tokenizer, by default the model's)."""
    from lm_eval import simple_evaluate

    refuse_reconstruction(variants)
    metadata = task.lm_eval_metadata()
    if "tokenizer" not in metadata and "pretrained" not in metadata:
        metadata["tokenizer"] = model_tokenizer(loaded)
    manager = task_manager(list(task.tasks), metadata)
    objects = load_tasks(manager, list(task.tasks))
    plan = choose_metrics(manager.load(objects)["tasks"], task.metric)
    kwargs = {
        "tasks": objects,
        "task_manager": manager,
        "limit": task.limit,
        "log_samples": True,
        "num_fewshot": task.num_fewshot,
        "bootstrap_iters": 0,
        "gen_kwargs": task.lm_eval_gen_kwargs(),
    }
    runs, results, baseline = [], {}, None
    for variant in variants:
        lm = EvalkitLM(loaded, variant)
        run = simple_evaluate(model=lm, **kwargs)
        if baseline is None:
            baseline = simple_evaluate(model=lm.baseline(), **kwargs)
            results[BASELINE] = baseline["results"]
        results[variant.name] = run["results"]
        runs.append((lm, run))
    return documents(runs, baseline, plan), results
