"""The `evalkit` model for lm-evaluation-harness: every request answered twice from one prefill, by the full cache
(the baseline) and by the compressed one (the variant); the baseline's answers replayed through lm-eval."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import torch
from lm_eval.api.model import LM
from torch import Tensor
from tqdm import tqdm

from evalkit.engine import models
from evalkit.engine.engine import Compressed, Outcome, compress_context, decode, run_sample
from evalkit.engine.rows import baseline_fields, kv_fields
from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant
from evalkit.records import BASELINE
from evalkit.tasks.prompt import Prompt, context_digest


def _key(kind: str, args: tuple) -> str:
    return json.dumps([kind, *args], sort_keys=True, default=str)


# Per-document record fields that take the largest value over the document's requests (its choices).
MAXED = (
    "peak_kv_bytes",
    "prefill_peak_kv_bytes",
    "prefill_peak_tokens",
    "kv_bytes_final",
    "decode_peak_kv_bytes_deployed",
    "decode_peak_kv_bytes_baseline_deployed",
)


def _scored(logits: list[Tensor], targets: Tensor) -> tuple[float, bool]:
    """(sum of log-probabilities of targets (M,), whether each was the greedy choice) from logits[j] predicting
    targets[j]."""
    if not logits:
        return 0.0, True
    lp = torch.stack(logits).log_softmax(-1)
    return float(lp.gather(1, targets[:, None]).sum()), bool((lp.argmax(-1) == targets).all())


class EvalkitLM(LM):
    """An lm-eval model running evalkit variants beside the full-cache baseline, on a loaded model: each context is
    prefilled once and compressed for every variant (prefill once, compress many). lm-eval scores the first
    variant's answers; the baseline's and the other variants' are replayed (`baseline()`, `replay(name)`). lm-eval's
    command line builds it from strings (evalkit.cli.lmeval.CommandLineLM); the run pipeline from objects. Its
    variants' policies come prepared (KVPolicy.prepare, once per policy: evalkit.engine.hf.prepare_policies), by
    whoever loaded the model (LmevalEngine.open, CommandLineLM)."""

    def __init__(
        self,
        loaded: models.LoadedModel,
        variant: Variant | list[Variant],
        max_gen_toks: int = 64,
        rolling_split: float = 0.5,
        metric: str | None = None,
        records: str | None = None,
    ):
        super().__init__()
        self.loaded, self.model, self.tok = loaded, loaded.model, loaded.tokenizer
        self.variants = list(variant) if isinstance(variant, list) else [variant]
        self.variant = self.variants[0]  # the one lm-eval scores directly
        self.max_gen_toks, self.rolling_split = int(max_gen_toks), float(rolling_split)
        # lm-eval's command line (main): the per-document metric of the paired records, and where they are written
        self.metric, self.records = metric, records
        # by variant name (and `baseline`): the answers to every request seen, and per (task, doc) the KV bytes of
        # its requests (compressed context, final, peak)
        names = [BASELINE, *(v.name for v in self.variants)]
        self.answers: dict[str, dict[str, Any]] = {n: {} for n in names}
        self.kv_of: dict[str, dict[tuple[str, int], dict[str, Any]]] = {n: {} for n in names}

    def baseline(self) -> LM:
        """An lm-eval model that replays the baseline's answers to the requests this one has seen."""
        return self.replay(BASELINE)

    def replay(self, name: str) -> LM:
        """An lm-eval model that replays variant `name`'s (or the baseline's) answers to the requests seen."""
        return _Replay(self.answers[name])

    # -- helpers ------------------------------------------------------------------------------------------
    def _ids(self, text: str, special: bool = True) -> list[int]:
        return self.tok(text, add_special_tokens=special).input_ids

    def _context(self, ids: Tensor, where: str) -> Compressed:
        """Prefill ids (1, n) once and compress them for every variant as the engine does
        (evalkit.engine.engine.compress_context)."""
        for v in self.variants:
            v.check(ids.shape[1], where)
        return compress_context(self.model, ids, self.variants)

    def _all(self, compressed: Compressed, tokens: Tensor) -> tuple[Outcome, list[Outcome]]:
        """(baseline, each variant) teacher-forced on tokens (1, M) after the compressed context, as the engine
        decodes a continuation: one token a step, a policy evicting while decoding if it does; logits[j] predicts
        tokens[j + 1]."""
        return decode(self.model, compressed, tokens, 0, set(), forced=True)

    def _answer(self, kind: str, args: tuple, baseline: Any, answers: list[Any]) -> Any:
        """Keep every variant's answer and the baseline's to a request for the replays; the first variant's, which
        lm-eval scores directly."""
        for name, answer in zip([BASELINE, *(v.name for v in self.variants)], [baseline, *answers], strict=True):
            self.answers[name][_key(kind, args)] = answer
        return answers[0]

    def _note(self, request, outcomes: list[Outcome], baseline: Outcome, context: Tensor) -> None:
        """The KV bytes of a request's variants and baseline, recorded for its document (fields as in the engine's
        records; the peaks and final bytes are the largest over the document's requests); `context` (1, n): the ids
        prefilled and compressed, which name the document's context (its first request's)."""
        n_context = context.shape[1]
        context_id = context_digest(context[0].cpu().numpy().tobytes())
        key = (request.task_name, request.doc_id)
        noted = [(self.kv_of[v.name], o, v) for v, o in zip(self.variants, outcomes, strict=True)]
        for store, o, which in [*noted, (self.kv_of[BASELINE], baseline, None)]:
            # an lm-eval document is one row: its document is what its first request prefilled, as its context
            ids = {"context_id": context_id, "document_id": context_id}
            new = {**kv_fields(o, which, n_context), **baseline_fields(baseline), **ids}
            old = store.get(key, {})
            store[key] = {**new, **{k: max(new[k], old[k]) for k in MAXED if k in old}}
            if "context_id" in old:
                store[key].update(context_id=old["context_id"], document_id=old["document_id"])

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
                baseline, outcomes = self._all(prefilled, torch.cat([ids[0, -1:], targets])[None])
                scored = [_scored(o.logits, targets) for o in outcomes]
                out[i] = self._answer("loglikelihood", requests[i].args, _scored(baseline.logits, targets), scored)
                self._note(requests[i], outcomes, baseline, ids[:, :-1])
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
            baseline, outcomes = self._all(prefilled, tail)
            base, *scored = (head_lp + _scored(o.logits, tail[0, 1:])[0] for o in [baseline, *outcomes])
            out.append(self._answer("loglikelihood_rolling", req.args, base, scored))
            self._note(req, outcomes, baseline, ids_t[:, : split - 1])
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
            for v in self.variants:
                v.check(prompt.n_context, "generate_until context")
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            base, outcomes = run_sample(self.model, prompt, self.variants, max_new, stop)
            self._note(req, outcomes, base, ids[:, : prompt.n_context])
            base_text, *texts = (
                self._cut(self.tok.decode(o.tokens, skip_special_tokens=True), until) for o in [base, *outcomes]
            )
            out.append(self._answer("generate_until", req.args, base_text, texts))
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
