"""lm-eval integration: the `evalkit` model for lm-evaluation-harness, with any policy and quantization.

Every request is answered twice from one prefill: by the full cache (the baseline) and by the compressed one
(the variant). lm-eval scores the variant's answers; the baseline's are kept and replayed through lm-eval a
second time (`EvalkitLM.baseline()`), so both are scored by lm-eval's own metrics on the same documents.

Every request type runs as the engine runs a sample (`evalkit.engine.run_sample`): the context is prefilled and
compressed (in one shot, or in chunks for `:chunkN` variants), then the continuation is fed one token at a time
(`teacher_forced`, or `greedy` for generate_until), and a policy with `decode=true` evicts back to its budget after
every forward. One compressed context serves every choice of a multiple-choice item (each choice runs on its own
copy). The KV bytes recorded per document are the engine's: held after compression, at the end, and the peak over
prefill (the full cache exists during a one-shot prefill), compression and every step before its eviction.

    python -m evalkit task=lm_eval 'task.tasks=[evalkit_recall]' policy=snapkv     # through evalkit
    python -m evalkit.lmeval --model evalkit --model_args model=tiny-random,variant=snapkv@0.5 \\
        --tasks evalkit_recall                                                      # lm-eval's own command line

Both routes write the same paired records (samples.jsonl: a baseline and a variant row per document, with flips;
summary.json; run.json). Each row is scored by one per-document metric chosen before any document runs
(plan_metrics: `task.metric`, or a default per task, or a refusal); for lm-eval's RULER (Hsieh et al. 2024, "RULER:
What's the Real Context Size of Your Long-Context Language Models?", arXiv:2404.06654) that is the score at the
document's own length, never the -1 lm-eval logs under the lengths a document was not generated at.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from omegaconf import DictConfig, OmegaConf
from platformdirs import user_cache_dir
from torch import Tensor
from tqdm import tqdm
from transformers.cache_utils import Cache

from evalkit import models
from evalkit.cache import kv_bytes, share
from evalkit.config import variants as parse_variants
from evalkit.engine import (
    Held,
    Outcome,
    Variant,
    chunked_prefill,
    evictor,
    outcome,
    prefill,
    run_sample,
    teacher_forced,
)
from evalkit.errors import ConfigError
from evalkit.policies import Need
from evalkit.prompt import Prompt, context_digest

TASKS = ("evalkit_recall",)


def task_dir() -> Path:
    """A folder holding the bundled offline tasks' YAML, pointing at the bundled JSONL by absolute path."""
    out = Path(user_cache_dir("evalkit")) / "lmeval_tasks"
    out.mkdir(parents=True, exist_ok=True)
    src = files("evalkit.lmeval_tasks")
    for name in TASKS:
        data = Path(str(src / f"{name}.jsonl"))
        text = (src / f"{name}.yaml").read_text().replace("__DATA__", json.dumps(str(data)))
        (out / f"{name}.yaml").write_text(text)
    return out


@functools.cache
def task_manager():
    """lm-eval's task index with evalkit's offline tasks included (built once: it scans every task YAML)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir()))


def _key(kind: str, args: tuple) -> str:
    return json.dumps([kind, *args], sort_keys=True, default=str)


# Per-document record fields that take the largest value over the document's requests (its choices).
MAXED = ("peak_kv_bytes", "prefill_peak_kv_bytes", "prefill_peak_tokens", "kv_bytes_final")


@dataclass
class _Context:
    """A prefilled context: the full cache (the baseline's) and the variant's, with what each prefill held at most
    (bytes, and tokens of an evicting layer per KV head)."""

    full: Cache
    cache: Cache
    n: int
    full_peak: tuple[int, int]
    peak: tuple[int, int]


def _scored(logits: list[Tensor], targets: Tensor) -> tuple[float, bool]:
    """(sum of log-probabilities of targets (M,), whether each was the greedy choice) from logits[j] predicting
    targets[j]."""
    if not logits:
        return 0.0, True
    lp = torch.stack(logits).log_softmax(-1)
    return float(lp.gather(1, targets[:, None]).sum()), bool((lp.argmax(-1) == targets).all())


# What `--model_args` takes for the evalkit model (EvalkitLM's own arguments).
MODEL_ARGS = ("model", "variant", "device", "max_gen_toks", "rolling_split", "metric", "records")


def unknown_arg(key: str) -> str:
    near = difflib.get_close_matches(key, MODEL_ARGS, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return f"--model_args {key}=...: the evalkit model takes no {key!r}{hint}; its arguments: {', '.join(MODEL_ARGS)}"


def model_config(name: str) -> DictConfig:
    """conf/model/NAME.yaml, or a ConfigError listing the model names there."""
    path = files("evalkit.conf") / "model" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.name[:-5] for p in (files("evalkit.conf") / "model").iterdir() if p.name.endswith(".yaml"))
        near = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"--model_args model={name!r}: unknown model{hint}; valid names: {', '.join(names)}")
    return OmegaConf.load(path)


@register_model("evalkit")
class EvalkitLM(LM):
    """An lm-eval model running an evalkit variant (`variant=snapkv@0.25+int4`) beside the full-cache baseline."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        variant: str = "none@1.0",
        device: str = "cpu",
        max_gen_toks: int = 64,
        rolling_split: float = 0.5,
        loaded: models.LoadedModel | None = None,
        metric: str | None = None,
        records: str | None = None,
        batch_size: Any = None,  # lm-eval passes these to every model; evalkit decodes one request at a time
        max_batch_size: Any = None,
        **unknown: Any,
    ):
        super().__init__()
        if unknown:
            raise ConfigError(unknown_arg(sorted(unknown)[0]))
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            print(f"evalkit: device={device} but CUDA is not available; running on the CPU", file=sys.stderr)
            device = "cpu"
        if loaded is None:
            loaded = models.load(model_config(model), device)
        self.loaded, self.model, self.tok = loaded, loaded.model, loaded.tokenizer
        (self.variant,) = parse_variants(OmegaConf.create({"seed": 0, "variants": [variant]}))
        self.max_gen_toks, self.rolling_split = int(max_gen_toks), float(rolling_split)
        # lm-eval's command line (main): the per-document metric of the paired records, and where they are written
        self.metric, self.records = metric, records
        self.baseline_answers: dict[str, Any] = {}
        # (task, doc) -> the KV bytes of its requests: the variant's (compressed context, final, peak), the baseline's
        self.kv: dict[tuple[str, int], dict[str, Any]] = {}
        self.kv_baseline: dict[tuple[str, int], dict[str, Any]] = {}

    @classmethod
    def for_variant(cls, loaded: models.LoadedModel, variant: Variant) -> EvalkitLM:
        lm = cls(loaded=loaded)
        lm.variant = variant
        variant.policy.prepare(loaded.model, loaded.tokenizer)  # once per policy (DuoAttention's head roles)
        return lm

    def baseline(self) -> LM:
        """An lm-eval model that replays the baseline's answers to the requests this one has seen."""
        return _Replay(self.baseline_answers)

    # -- helpers ------------------------------------------------------------------------------------------
    def _ids(self, text: str, special: bool = True) -> list[int]:
        return self.tok(text, add_special_tokens=special).input_ids

    def _context(self, ids: Tensor, where: str) -> _Context:
        """Prefill ids (1, n) and compress them as the engine does: one full-cache prefill, which the baseline
        keeps and a one-shot variant compresses; a chunked variant prefills the context itself, chunk by chunk."""
        n, variant = ids.shape[1], self.variant
        variant.check(n, where)
        full, obs = prefill(self.model, ids, [variant.policy] if variant.chunk is None else [])
        full_peak = (kv_bytes(full), n)
        if variant.chunk is None:
            return _Context(full, variant.apply(full, obs), n, full_peak, full_peak)
        cache, peak_bytes, peak_tokens = chunked_prefill(self.model, ids, variant.policy, variant.chunk)
        return _Context(full, cache, n, full_peak, (peak_bytes, peak_tokens))

    def _forced(self, name: str, cache: Cache, tokens: Tensor, prefill_peak: tuple[int, int], evict: bool) -> Outcome:
        """Teacher-force tokens (1, M) on a copy of cache, as `run_sample(forced=True)` does: one token a step, the
        variant's policy evicting after every forward when it evicts while decoding; logits[j] predicts tokens[j+1].
        """
        held = Held.of(cache)
        cache, policy = share(cache), self.variant.policy
        after = evictor(cache, policy) if evict else None
        return outcome(name, held, cache, teacher_forced(self.model, cache, tokens, after), prefill_peak)

    def _both(self, ctx: _Context, tokens: Tensor) -> tuple[Outcome, Outcome]:
        """(variant, baseline) teacher-forced on tokens after the prefilled context."""
        return (
            self._forced(self.variant.name, ctx.cache, tokens, ctx.peak, evict=True),
            self._forced("baseline", ctx.full, tokens, ctx.full_peak, evict=False),
        )

    def _note(self, request, variant: Outcome, baseline: Outcome, context: Tensor) -> None:
        """The KV bytes of a request's variant and baseline, recorded for its document (fields as in the engine's
        records; the peaks and final bytes are the largest over the document's requests); `context` (1, n): the ids
        prefilled and compressed, which name the document's context (its first request's)."""
        chunk, n_context = self.variant.chunk, context.shape[1]
        fields = {
            "context_id": context_digest(context[0].cpu().numpy().tobytes()),
            "kv_bytes_baseline": baseline.kv_bytes,
            "kv_bytes_baseline_deployed": baseline.kv_bytes_deployed,
            "prefill": {"mode": "chunked", "chunk": chunk} if chunk else {"mode": "oneshot"},
            "prefill_bound_tokens": self.variant.policy.target(n_context) + chunk if chunk else None,
            "context_tokens": n_context,
        }
        key = (request.task_name, request.doc_id)
        for store, o, extra in (
            (self.kv, variant, {}),
            (self.kv_baseline, baseline, {"prefill": {"mode": "oneshot"}, "prefill_bound_tokens": None}),
        ):
            new = {
                **fields,
                "kv_bytes": o.kv_bytes,
                "kv_bytes_fp16_same_tokens": o.kv_bytes_fp16,
                "kv_bytes_deployed": o.kv_bytes_deployed,
                "attention_path": o.attention_path,
                "kv_bytes_final": o.kv_bytes_final,
                "peak_kv_bytes": o.peak_kv_bytes,
                "prefill_peak_kv_bytes": o.prefill_peak_kv_bytes,
                "prefill_peak_tokens": o.prefill_peak_tokens,
                "tokens_held_per_layer": o.tokens_held,
                "tokens_allocated_per_layer": o.tokens_allocated,
                "tokens_allowed_per_layer": o.tokens_allowed,
                **extra,
            }
            old = store.get(key, {})
            store[key] = {**new, **{k: max(new[k], old[k]) for k in MAXED if k in old}}
            if "context_id" in old:
                store[key]["context_id"] = old["context_id"]

    # -- lm-eval's request types --------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        by_context: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_context[req.args[0]].append(i)
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for context, indices in tqdm(by_context.items(), disable=disable_tqdm, desc="loglikelihood"):
            # As lm-eval's HF model: trailing spaces of the context belong to the continuation.
            ctx = context.rstrip()
            ctx_ids = self._ids(ctx) or [self.tok.eos_token_id]
            ids = torch.tensor([ctx_ids], device=self.model.device)
            # As generate_until's prompt: the context but its last token is prefilled; that token is fed first.
            prefilled = self._context(ids[:, :-1], f"context of request {indices[0]}")
            for i in indices:
                cont = context[len(ctx) :] + requests[i].args[1]
                cont_ids = self._ids(ctx + cont)[len(ctx_ids) :] or self._ids(cont, special=False)
                targets = torch.tensor(cont_ids, dtype=torch.long, device=ids.device)
                variant, baseline = self._both(prefilled, torch.cat([ids[0, -1:], targets])[None])
                out[i] = _scored(variant.logits, targets)
                self.baseline_answers[_key("loglikelihood", requests[i].args)] = _scored(baseline.logits, targets)
                self._note(requests[i], variant, baseline, ids[:, :-1])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="loglikelihood_rolling"):
            ids = [self.tok.bos_token_id or self.tok.eos_token_id] + self._ids(req.args[0], special=False)
            limit = self.model.config.max_position_embeddings
            if len(ids) > limit:
                raise ConfigError(f"a rolling-loglikelihood document of {len(ids)} tokens exceeds {limit}")
            ids_t = torch.tensor([ids], device=self.model.device)
            split = max(2, int(len(ids) * self.rolling_split))
            with torch.inference_mode():  # the first part: the full model, the same for baseline and variant
                head = self.model(input_ids=ids_t[:, :split], use_cache=False).logits[0].float().log_softmax(-1)
            head_lp = float(head[:-1].gather(1, ids_t[0, 1:split, None]).sum())
            # the rest: a context of split - 1 tokens prefilled and compressed, then teacher-forced from its last
            prefilled = self._context(ids_t[:, : split - 1], "rolling document")
            tail = ids_t[:, split - 1 :]
            variant, baseline = self._both(prefilled, tail)
            out.append(head_lp + _scored(variant.logits, tail[0, 1:])[0])
            base = head_lp + _scored(baseline.logits, tail[0, 1:])[0]
            self.baseline_answers[_key("loglikelihood_rolling", req.args)] = base
            self._note(req, variant, baseline, ids_t[:, : split - 1])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        stop = {self.tok.eos_token_id}
        for req in tqdm(requests, disable=disable_tqdm, desc="generate_until"):
            context, gen_kwargs = req.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = torch.tensor([self._ids(context)])
            prompt = Prompt(ids, ids.shape[1] - 1, [], "query_agnostic")
            self.variant.check(prompt.n_context, "generate_until context")
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            base, (var,) = run_sample(self.model, prompt, [self.variant], max_new, stop)
            self._note(req, var, base, ids[:, : prompt.n_context])
            texts = [self._cut(self.tok.decode(o.tokens, skip_special_tokens=True), until) for o in (var, base)]
            out.append(texts[0])
            self.baseline_answers[_key("generate_until", req.args)] = texts[1]
        return out

    @staticmethod
    def _cut(text: str, until: list[str]) -> str:
        for s in until:
            if s and s in text:
                text = text[: text.index(s)]
        return text


class _Replay(LM):
    """Answers requests with stored answers (the baseline computed beside a variant); computes nothing."""

    def __init__(self, answers: dict[str, Any]):
        super().__init__()
        self.answers = answers

    def _get(self, kind: str, requests) -> list:
        missing = [r.args for r in requests if _key(kind, r.args) not in self.answers]
        if missing:
            raise RuntimeError(f"{len(missing)} {kind} requests were not answered by the variant run first")
        return [self.answers[_key(kind, r.args)] for r in requests]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._get("loglikelihood", requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._get("loglikelihood_rolling", requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._get("generate_until", requests)


def refuse_reconstruction(variants: list[Variant]) -> None:
    for variant in variants:
        if Need.RECONSTRUCTION in variant.policy.needs:
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
    import random

    import numpy as np

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


# A per-document metric for the task families that log several: LongBench's unified `score` (equal to the task's own
# metric, qa_f1_score, rouge_score, ...; the one its groups aggregate).
DEFAULT_METRICS = {"longbench_": "score"}
OWN_LENGTH = None  # plan_metrics' entry for RULER: each document is scored under its own length


def _metric_names(task) -> list[str]:
    return [str(m) for m in task.aggregation()]


def _is_ruler(task, names: list[str]) -> bool:
    """RULER's layout (lm_eval/tasks/ruler/common_utils.process_results): one metric per sequence length, the
    document's own `max_length` holding its score and every other length the placeholder -1."""
    if not names or not all(n.isdigit() for n in names):
        return False
    docs = task.eval_docs
    return len(docs) > 0 and "max_length" in docs[0]


def plan_metrics(
    tasks: dict[str, Any], wanted: str | dict[str, str] | None, key: str = "task.metric"
) -> dict[str, str | None]:
    """The per-document metric each lm-eval task's rows are scored by, chosen before any document runs.

    `wanted` (task.metric): one name for every task, or {task: name}. Unset, a task's metric is its only one;
    RULER's is the document's own length (OWN_LENGTH: never another length's -1 placeholder); LongBench's `score`.
    A task that logs several metrics and has no default is refused (ConfigError), as is a name it does not log;
    errors name the setting as the user gave it (`key`: task.metric, or lm-eval's `--model_args metric`)."""
    if isinstance(wanted, dict):
        unknown = sorted(set(wanted) - set(tasks))
        if unknown:
            raise ConfigError(
                f"{key} names {', '.join(map(repr, unknown))}, not among the tasks run: {', '.join(tasks)}"
            )
    plan: dict[str, str | None] = {}
    for name, task in tasks.items():
        names = _metric_names(task)
        asked = wanted.get(name) if isinstance(wanted, dict) else wanted
        if _is_ruler(task, names):
            lengths = sorted({int(d["max_length"]) for d in task.eval_docs})
            if asked is not None and [str(n) for n in lengths] != [str(asked)]:
                raise ConfigError(
                    f"{key}={asked!r} for {name}: RULER scores each document under its own length "
                    f"({', '.join(map(str, lengths))} here) and logs -1 under every other one; leave {key} "
                    "unset for RULER"
                )
            plan[name] = OWN_LENGTH
        elif asked is not None:
            if asked not in names:
                raise ConfigError(f"{key}={asked!r}: lm-eval task {name!r} logs {', '.join(names)} per document")
            plan[name] = asked
        else:
            default = next((m for p, m in DEFAULT_METRICS.items() if name.startswith(p) and m in names), None)
            if default is None and len(names) != 1:
                raise ConfigError(
                    f"lm-eval task {name!r} logs several per-document metrics ({', '.join(names)}): choose the one "
                    f"flips are scored by with {key}={names[0] if names else 'NAME'} "
                    f"(or {key}.{name}=...; from lm-eval's command line, --model_args metric=...)"
                    if names
                    else f"lm-eval task {name!r} logs no per-document metric; evalkit's records need one"
                )
            plan[name] = default or names[0]
    return plan


def doc_score(task: str, doc: dict, plan: dict[str, str | None]) -> tuple[str, float]:
    """(metric, value) of a logged lm-eval document under the planned metric; a placeholder is never a score."""
    metric = plan[task]
    if metric is OWN_LENGTH:
        metric = str(doc["doc"]["max_length"])
        if doc.get(metric) == -1:
            raise RuntimeError(f"{task}/{doc['doc_id']}: RULER logged its -1 placeholder at the document's own length")
    value = doc.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"lm-eval task {task!r} logged no numeric {metric!r} for document {doc['doc_id']}")
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ConfigError(
            f"lm-eval task {task!r} logged {metric}={value!r} for document {doc['doc_id']}: the gate judges "
            "per-document scores in [0, 1] (right = 1); choose such a metric (task.metric, or --model_args metric=...)"
        )
    return metric, float(value)


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

    Each row: task, doc id, variant, the planned per-document metric (plan_metrics) as the score, the baseline's
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
    plan = plan_metrics(manager.load(objects)["tasks"], task.metric)
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
        lm = EvalkitLM.for_variant(loaded, variant)
        run = simple_evaluate(model=lm, **kwargs)
        if baseline is None:
            baseline = simple_evaluate(model=lm.baseline(), **kwargs)
            results["baseline"] = baseline["results"]
        results[variant.name] = run["results"]
        rows += paired_rows(variant.name, lm, run, baseline, plan, with_baseline=variant is variants[0])
    return rows, results


def write_records(out_dir: Path, rows: list[dict], run_info: dict, task_name: str) -> dict:
    """samples.jsonl (rows with flips, as the Hydra route writes them), run.json and summary.json in out_dir; the
    summary."""
    from evalkit.analysis import format_summary, summarize
    from evalkit.evidence import flip
    from evalkit.records import RUN, SAMPLES, SUMMARY, RecordWriter, read_rows, write_json

    if (out_dir / SAMPLES).exists():
        raise ConfigError(f"{out_dir} already holds results; choose another folder with --model_args records=DIR")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / RUN, run_info)
    writer = RecordWriter(out_dir / SAMPLES)
    try:
        for row in rows:
            flipped = flip(row["score"], row["baseline_score"])
            writer.write(
                {
                    "run_id": run_info["run_id"],
                    "task": task_name,
                    "protocol": run_info["protocol"],
                    "flip": flipped,
                    **row,
                }
            )
    finally:
        writer.close()
    summary = summarize(read_rows(out_dir / SAMPLES))
    write_json(out_dir / SUMMARY, summary)
    print(format_summary(summary), file=sys.stderr)
    print(
        f"evalkit: paired records (baseline and {rows[0]['variant'] if rows else 'variant'}): {out_dir}",
        file=sys.stderr,
    )
    return summary


def _paired_evaluate(real, *, model=None, model_args=None, **kwargs):
    """lm-eval's simple_evaluate for its command line: `--model evalkit` runs the variant, replays its baseline
    through lm-eval on the same task objects, and writes evalkit's paired records (write_records) beside lm-eval's
    own output; the variant's results go back to lm-eval's command line. Any other model runs as lm-eval runs it."""
    if model != "evalkit":
        return real(model=model, model_args=model_args, **kwargs)
    import time
    import uuid

    from lm_eval.tasks import TaskManager
    from lm_eval.utils import simple_parse_args_string

    from evalkit.records import versions

    if kwargs.get("use_cache"):
        raise ConfigError("--use_cache: a cached answer has no baseline beside it; run the evalkit model without it")
    args = simple_parse_args_string(model_args) if isinstance(model_args, str) else dict(model_args or {})
    extra = {k: kwargs.get(k) for k in ("batch_size", "max_batch_size", "device")}
    lm = EvalkitLM.create_from_arg_obj(args, extra)
    refuse_reconstruction([lm.variant])
    manager = kwargs.pop("task_manager", None)
    include = manager.include_path if manager is not None else str(task_dir())
    metadata = {**args, **(kwargs.get("metadata") or {})}
    if not (metadata.get("tokenizer") or metadata.get("pretrained")):
        # RULER would read `model=` (evalkit's config name) as a tokenizer: size its haystacks with the model's own
        metadata["tokenizer"] = model_tokenizer(lm.loaded)
        manager = None
    manager = manager or TaskManager(include_path=include, metadata=metadata)
    names = kwargs.pop("tasks")
    objects = load_tasks(
        manager, list(names), {k: kwargs.get(k) for k in ("random_seed", "numpy_random_seed", "torch_random_seed")}
    )
    plan = plan_metrics(manager.load(objects)["tasks"], lm.metric, "--model_args metric")
    asked_samples = bool(kwargs.pop("log_samples", False))
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    run = real(model=lm, tasks=objects, task_manager=manager, log_samples=True, **kwargs)
    quiet = {**kwargs, "evaluation_tracker": None}
    baseline = real(model=lm.baseline(), tasks=objects, task_manager=manager, log_samples=True, **quiet)
    rows = paired_rows(lm.variant.name, lm, run, baseline, plan, with_baseline=True)
    label = "".join(c if c.isalnum() or c in "@.+-_" else "_" for c in lm.variant.name)
    out = Path(lm.records or Path("results") / "lm_eval_cli" / lm.loaded.name / label / started.replace(":", "-"))
    info = {
        "run_id": uuid.uuid4().hex[:12],
        "route": "lm_eval command line (python -m evalkit.lmeval)",
        "config": {
            "model": {"name": lm.loaded.name},
            "task": {
                "name": "lm_eval",
                "tasks": list(names),
                "limit": kwargs.get("limit"),
                "num_fewshot": kwargs.get("num_fewshot"),
                "metadata": kwargs.get("metadata"),
                "metric": lm.metric,
            },
            "variants": [lm.variant.name],
            "model_args": args,
            "protocol": "query_agnostic",
            "seed": 0,
        },
        "versions": versions(),
        "command": sys.argv,
        "started": started,
        "protocol": "query_agnostic",
        "seed": 0,
        "model": {
            "name": lm.loaded.name,
            "fingerprint": lm.loaded.fingerprint,
            "weights_bytes": sum(p.numel() * p.element_size() for p in lm.model.parameters()),
            "dtype": str(lm.model.dtype).removeprefix("torch."),
            "source": lm.loaded.source,
        },
    }
    write_records(out, rows, info, "lm_eval")
    from evalkit.records import write_json

    write_json(out / "lm_eval_results.json", {"baseline": baseline["results"], lm.variant.name: run["results"]})
    if not asked_samples:
        run.pop("samples", None)
    run.setdefault("config", {})["model"] = "evalkit"
    return run


def main() -> int:
    """lm-eval's own command line, with evalkit's model registered and its offline tasks on the include path,
    under evalkit's exit codes (lm-eval reports bad arguments, such as an unknown task, as ValueError: exit 2).
    With `--model evalkit`, the paired records are written too (_paired_evaluate)."""
    import lm_eval
    from lm_eval.__main__ import cli_evaluate

    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(task_dir())]
    real = lm_eval.simple_evaluate
    lm_eval.simple_evaluate = functools.partial(_paired_evaluate, real)
    try:
        cli_evaluate()
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"lm-eval: {str(err).splitlines()[0]}") from None
    finally:
        lm_eval.simple_evaluate = real
    return 0


if __name__ == "__main__":
    from evalkit.cli import guarded

    sys.exit(guarded(main))
