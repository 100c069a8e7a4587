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
"""

from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from omegaconf import OmegaConf
from platformdirs import user_cache_dir
from torch import Tensor
from tqdm import tqdm
from transformers.cache_utils import Cache

from evalkit import models
from evalkit.cache import enforce, kv_bytes, share
from evalkit.config import variants as parse_variants
from evalkit.engine import Held, Outcome, Variant, chunked_prefill, outcome, prefill, run_sample, teacher_forced
from evalkit.errors import ConfigError
from evalkit.prompt import Prompt

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
        **_: Any,
    ):
        super().__init__()
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            print(f"evalkit: device={device} but CUDA is not available; running on the CPU", file=sys.stderr)
            device = "cpu"
        if loaded is None:
            loaded = models.load(OmegaConf.load(files("evalkit.conf") / "model" / f"{model}.yaml"), device)
        self.loaded, self.model, self.tok = loaded, loaded.model, loaded.tokenizer
        (self.variant,) = parse_variants(OmegaConf.create({"seed": 0, "variants": [variant]}))
        self.max_gen_toks, self.rolling_split = int(max_gen_toks), float(rolling_split)
        self.baseline_answers: dict[str, Any] = {}
        # (task, doc) -> the KV bytes of its requests: the variant's (compressed context, final, peak), the baseline's
        self.kv: dict[tuple[str, int], dict[str, Any]] = {}
        self.kv_baseline: dict[tuple[str, int], dict[str, Any]] = {}

    @classmethod
    def for_variant(cls, loaded: models.LoadedModel, variant: Variant) -> EvalkitLM:
        lm = cls(loaded=loaded)
        lm.variant = variant
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
        after = (lambda: enforce(cache, policy)) if evict and policy.decode else None
        return outcome(name, held, cache, teacher_forced(self.model, cache, tokens, after), prefill_peak)

    def _both(self, ctx: _Context, tokens: Tensor) -> tuple[Outcome, Outcome]:
        """(variant, baseline) teacher-forced on tokens after the prefilled context."""
        return (
            self._forced(self.variant.name, ctx.cache, tokens, ctx.peak, evict=True),
            self._forced("baseline", ctx.full, tokens, ctx.full_peak, evict=False),
        )

    def _note(self, request, variant: Outcome, baseline: Outcome, n_context: int) -> None:
        """The KV bytes of a request's variant and baseline, recorded for its document (fields as in the engine's
        records; the peaks and final bytes are the largest over the document's requests)."""
        chunk = self.variant.chunk
        fields = {
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
                **extra,
            }
            old = store.get(key, {})
            store[key] = {**new, **{k: max(new[k], old[k]) for k in MAXED if k in old}}

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
                self._note(requests[i], variant, baseline, prefilled.n)
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
            self._note(req, variant, baseline, prefilled.n)
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
            self._note(req, var, base, prompt.n_context)
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


def evaluate(task, loaded: models.LoadedModel, variants: list[Variant]) -> tuple[list[dict], dict]:
    """Run lm-eval tasks for every variant and, by replay, the baseline; per-document rows and lm-eval's results.

    Each row: task, doc id, variant, the task's first per-document numeric metric as the score, the baseline's
    score on the same document, and the KV bytes of the document's compressed context.
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir()))
    kwargs = {
        "tasks": list(task.tasks),
        "task_manager": manager,
        "limit": task.limit,
        "log_samples": True,
        "num_fewshot": task.num_fewshot,
        "bootstrap_iters": 0,
    }
    rows, results, baseline = [], {}, None
    for variant in variants:
        lm = EvalkitLM.for_variant(loaded, variant)
        run = simple_evaluate(model=lm, **kwargs)
        if baseline is None:
            baseline = simple_evaluate(model=lm.baseline(), **kwargs)
            results["baseline"] = baseline["results"]
        results[variant.name] = run["results"]
        for name, docs in run["samples"].items():
            metric = _doc_metric(name, docs[0])
            base = {d["doc_id"]: float(d[metric]) for d in baseline["samples"][name]}
            for d in docs:
                kv = lm.kv.get((name, d["doc_id"]), {})
                kv_base = lm.kv_baseline.get((name, d["doc_id"]), {})
                sid = f"{name}/{d['doc_id']}"
                rows.append(
                    {
                        "sample_id": sid,
                        "cell": {"lm_eval_task": name},
                        "variant": variant.name,
                        "score": float(d[metric]),
                        "baseline_score": base[d["doc_id"]],
                        "metric": metric,
                        **kv,
                    }
                )
                if variant is variants[0]:
                    rows.append(
                        {
                            "sample_id": sid,
                            "cell": {"lm_eval_task": name},
                            "variant": "baseline",
                            "score": base[d["doc_id"]],
                            "baseline_score": base[d["doc_id"]],
                            "metric": metric,
                            **kv_base,
                        }
                    )
    return rows, results


def _doc_metric(task: str, doc: dict) -> str:
    """The first metric of a logged document with a numeric value (acc, exact_match, ...)."""
    for key in doc.get("metrics", []):
        if isinstance(doc.get(key), (int, float)):
            return key
    raise ConfigError(f"lm-eval task {task!r} logs no per-document numeric metric; evalkit's records need one")


def main() -> int:
    """lm-eval's own command line, with evalkit's model registered and its offline tasks on the include path,
    under evalkit's exit codes (lm-eval reports bad arguments, such as an unknown task, as ValueError: exit 2)."""
    from lm_eval.__main__ import cli_evaluate

    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(task_dir())]
    try:
        cli_evaluate()
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"lm-eval: {str(err).splitlines()[0]}") from None
    return 0


if __name__ == "__main__":
    from evalkit.cli import guarded

    sys.exit(guarded(main))
