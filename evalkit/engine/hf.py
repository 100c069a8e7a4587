"""evalkit's own engine (`backend=hf`) as the sample loop drives it: the model loaded and the policies prepared, then
per job one prefill and compression for the questions on a context (compress_context), the baseline and every
variant decoded in one batch (decode), each outcome a Result with its row fields."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from evalkit import contract
from evalkit.engine import models
from evalkit.engine.divergence import logit_divergence
from evalkit.engine.engine import Outcome, compress_context, decode
from evalkit.engine.probes import NeedleProbes
from evalkit.engine.rows import budget_clipped, hf_engine, kv_fields, prediction_text
from evalkit.kv.variant import Variant
from evalkit.modelspec import ModelSpec
from evalkit.records import Job, Result
from evalkit.tasks import Task


class HFEngine:
    """The baseline and `variants` of `task` on `model`, on `device`."""

    protocol = None  # the run's: evalkit's protocols say which tokens this engine compresses
    interruptible = True

    def __init__(self, model: ModelSpec, device: str, task: Task, variants: list[Variant]):
        self.model, self.device, self.task, self.variants = model, device, task, variants
        self.loaded: models.LoadedModel | None = None

    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]

    def open(self, jobs: list[Job]) -> dict[str, Any]:
        """Load the weights and let each policy learn what it needs from them; run.json's `model` and `prepared`."""
        self.loaded = models.load(self.model, self.device)
        opened: dict[str, Any] = {"model": self.loaded.info()}
        prepared = prepare_policies(self.variants, self.loaded)
        if prepared:
            opened["prepared"] = prepared
        return opened

    def run(self, jobs: list[Job]) -> Generator[tuple[Job, list[Result]]]:
        loaded = self.loaded
        stop_ids = _stop_ids(loaded)
        context = None
        for job in jobs:
            prompt = job.prompt
            ids = prompt.ids.to(loaded.model.device)
            if prompt.context_ids != context:  # one prefill and compression for the questions on a context
                compressed = compress_context(loaded.model, ids[:, : prompt.n_context], self.variants, prompt.repeat)
                context = prompt.context_ids
            baseline, outcomes = decode(
                loaded.model, compressed, ids[:, prompt.n_context :], job.max_new_tokens, stop_ids,
                forced=self.task.teacher_forced, evidence=prompt.evidence,
            )  # fmt: skip
            yield job, self.results(job, baseline, outcomes)

    def results(self, job: Job, baseline: Outcome, outcomes: list[Outcome]) -> list[Result]:
        """The baseline's Result, then each variant's. Generated answers are scored by the task (in the loop);
        teacher-forced continuations here, by their fidelity to the baseline's logits (score = top-1 agreement, so
        the baseline scores 1)."""
        prompt = job.prompt
        fidelity: list[tuple[float | None, dict]] = [(None, {})] * (1 + len(outcomes))
        if self.task.teacher_forced:
            targets = prompt.ids[0, prompt.n_context + 1 :].tolist()
            divergences = [logit_divergence(baseline.logits, o.logits, targets) for o in [baseline, *outcomes]]
            fidelity = [(m["top1_agreement"], m) for m in divergences]
        out = []
        decoded = zip([None, *self.variants], [baseline, *outcomes], fidelity, strict=True)
        for variant, outcome, (score, extra) in decoded:
            fields = {
                **hf_engine(),
                **kv_fields(outcome, variant, prompt.n_context),
                "evidence_retained_per_layer": outcome.evidence_retained,
                "budget_clipped": budget_clipped(variant, prompt),
                "generated_tokens": len(outcome.tokens),
                "seconds": {k: round(v, 4) for k, v in outcome.seconds.items()},
                # decoded in one batch with this many caches (its seconds.decode a share of the batch's); or not
                # decoded at all: the variant named kept the same tokens, stored alike, and its decode is this
                # row's (evalkit.engine.outcome)
                "decode_batch": outcome.decode_batch,
                "decoded_like": outcome.decoded_like,
                **extra,
            }
            out.append(Result(outcome.variant, prediction_text(self.loaded, outcome), fields, score))
        return out

    def close(self) -> None:
        """Nothing to free: the weights go with the engine."""


def prepare_policies(variants: list[Variant], loaded: models.LoadedModel) -> dict[str, dict]:
    """Let each policy learn what it needs from the loaded model (KVPolicy.prepare); what they report, timed, by
    variant name."""
    prepared = {}
    for v in variants:
        t = time.perf_counter()
        with contract.calling(v.policy, "prepare"):
            info = v.policy.prepare(loaded.model, NeedleProbes(loaded.tokenizer))
        if info is not None:
            prepared[v.name] = {**info, "seconds": round(time.perf_counter() - t, 3)}
    return prepared


def _stop_ids(loaded: models.LoadedModel) -> set[int]:
    ids = {loaded.tokenizer.eos_token_id}
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list) else {eos}
    return {i for i in ids if i is not None}
