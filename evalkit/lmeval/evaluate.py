"""lm-eval tasks run for every variant and, by replay, the baseline: per-document paired rows and lm-eval's results
(task=lm_eval)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from platformdirs import user_cache_dir

from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant
from evalkit.lmeval.metrics import OWN_LENGTH, choose_metrics, doc_score
from evalkit.lmeval.model import EvalkitLM
from evalkit.lmeval.registry import task_dir
from evalkit.run import models


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


def paired_rows(
    name: str, lm: EvalkitLM, run: dict, baseline: dict, plan: dict[str, str | None], with_baseline: bool
) -> list[dict]:
    """One row per document for the variant (and, with_baseline, the baseline) from both runs' logged samples."""
    rows = []
    for task, docs in run["samples"].items():
        base = {d["doc_id"]: d for d in baseline["samples"][task]}
        for d in docs:
            b = base[d["doc_id"]]
            metric, score = doc_score(task, d, plan)
            _, base_score = doc_score(task, b, plan)
            cell = {"lm_eval_task": task}
            if plan[task] is OWN_LENGTH:
                cell["max_length"] = int(d["doc"]["max_length"])
            sid = f"{task}/{d['doc_id']}"
            common = {"sample_id": sid, "cell": cell, "baseline_score": base_score, "metric": metric}
            common["answers"] = d.get("target")
            key = (task, d["doc_id"])
            rows.append({**common, "variant": name, "score": score, **_response(d), **lm.kv.get(key, {})})
            if with_baseline:
                rows.append({**common, "variant": "baseline", "score": base_score, **_response(b)})
                rows[-1].update(lm.kv_baseline.get(key, {}))
    return rows


def _response(doc: dict) -> dict:
    """What the model answered, as lm-eval logged it after its filters: the text of a generation, else the scores."""
    resps = doc.get("filtered_resps")
    if isinstance(resps, list) and len(resps) == 1 and isinstance(resps[0], str):
        return {"prediction": resps[0]}
    return {"response": resps}


def evaluate(task, loaded: models.LoadedModel, variants: list[Variant]) -> tuple[list[dict], dict]:
    """Run lm-eval tasks for every variant and, by replay, the baseline; per-document rows and lm-eval's results.

    Each row: task, doc id, variant, the planned per-document metric (choose_metrics) as the score, the baseline's
    score on the same document, what each answered, and the KV bytes of the document's compressed context.
    `task.metadata` is lm-eval's task metadata (RULER's max_seq_lengths; its tokenizer, by default the model's).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    refuse_reconstruction(variants)
    metadata = task.lm_eval_metadata()
    if "tokenizer" not in metadata and "pretrained" not in metadata:
        metadata["tokenizer"] = model_tokenizer(loaded)
    manager = TaskManager(include_path=str(task_dir()), metadata=metadata)
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
    rows, results, baseline = [], {}, None
    for variant in variants:
        lm = EvalkitLM(loaded, variant)
        run = simple_evaluate(model=lm, **kwargs)
        if baseline is None:
            baseline = simple_evaluate(model=lm.baseline(), **kwargs)
            results["baseline"] = baseline["results"]
        results[variant.name] = run["results"]
        rows += paired_rows(variant.name, lm, run, baseline, plan, with_baseline=variant is variants[0])
    return rows, results
