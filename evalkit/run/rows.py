"""The record of one variant on one sample: the fields of a samples.jsonl row, built from the engine's Outcome."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import transformers

from evalkit.gate.summary import BASELINE
from evalkit.kv.variant import Variant
from evalkit.run import models
from evalkit.run.engine import Outcome
from evalkit.tasks import Sample, Task
from evalkit.tasks.prompt import Prompt


def prediction_text(loaded: models.LoadedModel, outcome: Outcome) -> str:
    return loaded.tokenizer.decode(outcome.tokens, skip_special_tokens=True).strip()


def hf_engine() -> dict[str, str]:
    """What every row of evalkit's own engine says produced it (issue 25: rows name their backend)."""
    return {"backend": "hf", "engine_version": f"transformers {transformers.__version__}, torch {torch.__version__}"}


def header(run_info: dict, task_name: str, protocol: str) -> dict[str, Any]:
    """What every row of a run written by evalkit's engine begins with: the run, the task, the protocol and the
    engine (the run's own samples and lm-eval's documents alike)."""
    return {"run_id": run_info["run_id"], "task": task_name, "protocol": protocol, **hf_engine()}


def kv_fields(outcome: Outcome, variant: Variant | None, n_context: int) -> dict[str, Any]:
    """The KV record of one decode (the baseline's when `variant` is None) after a context of n_context tokens:
    bytes held, peaks, tokens per layer and how the context was prefilled. One schema for the run's rows and
    lm-eval's (evalkit.lmeval.model)."""
    chunk = variant.chunk if variant is not None else None
    return {
        "kv_bytes": outcome.kv_bytes,
        "kv_bytes_fp16_same_tokens": outcome.kv_bytes_fp16,
        # as a deployment holds them (fp16/bf16 dense, quantized packed): what ratios, the gate and capacity use
        "kv_bytes_deployed": outcome.kv_bytes_deployed,
        "attention_path": outcome.attention_path,
        "kv_bytes_final": outcome.kv_bytes_final,
        "peak_kv_bytes": outcome.peak_kv_bytes,
        "prefill": {"mode": "chunked", "chunk": chunk} if chunk else {"mode": "oneshot"},
        "prefill_peak_kv_bytes": outcome.prefill_peak_kv_bytes,
        "prefill_peak_tokens": outcome.prefill_peak_tokens,
        # what a chunked prefill promises: an evicting layer never holds more than its final budget plus one chunk
        "prefill_bound_tokens": variant.policy.target(n_context) + chunk if chunk else None,
        "tokens_held_per_layer": outcome.tokens_held,
        "tokens_allocated_per_layer": outcome.tokens_allocated,
        "tokens_allowed_per_layer": outcome.tokens_allowed,
        "context_tokens": n_context,
    }


def baseline_fields(baseline: Outcome) -> dict[str, int]:
    """The baseline's bytes on the same context, carried by every row of a sample."""
    return {"kv_bytes_baseline": baseline.kv_bytes, "kv_bytes_baseline_deployed": baseline.kv_bytes_deployed}


def _row(
    run_info,
    task: Task,
    sample: Sample,
    prompt: Prompt,
    outcome: Outcome,
    baseline: Outcome,
    loaded,
    variant: Variant | None,
    protocol: str,
) -> dict[str, Any]:
    return {
        **header(run_info, task.name, protocol),
        "sample_id": sample.id,
        "cell": sample.cell,
        "variant": outcome.variant,
        "policy": dataclasses.asdict(variant.policy) if variant is not None else {"name": BASELINE},
        "quant": dataclasses.asdict(variant.quant) if variant is not None and variant.quant else None,
        "prediction": prediction_text(loaded, outcome),
        "answers": sample.answers,
        **scorer_field(task, sample),
        "question": sample.question,  # what was asked of the context: the report shows it beside a lost sample
        **kv_fields(outcome, variant, prompt.n_context),
        **baseline_fields(baseline),
        "evidence_retained_per_layer": outcome.evidence_retained,
        "budget_clipped": budget_clipped(variant, prompt),
        "context_id": prompt.context_id,  # the compressed context: questions answered from one prefill share it
        "document_id": prompt.document_id,  # the text before the question: the gate's unit, whatever the protocol
        "prompt_tokens": int(prompt.ids.shape[1]),
        "generated_tokens": len(outcome.tokens),
        "seconds": {k: round(v, 4) for k, v in outcome.seconds.items()},
        # decoded in one batch with this many caches (its seconds.decode a share of the batch's); or not decoded at
        # all: the variant named kept the same tokens, stored alike, and its decode is this row's (evalkit.run.outcome)
        "decode_batch": outcome.decode_batch,
        "decoded_like": outcome.decoded_like,
        **task.row_fields(sample),  # what a task records of each sample beyond these (task=hf: its truncation)
    }


def scorer_field(task: Task, sample: Sample) -> dict[str, Any]:
    """The scorer of a generated answer (evalkit.scoring.spec), with which the gate and resume score it again;
    nothing for a teacher-forced row (scored from logits)."""
    return {} if task.teacher_forced else {"scorer": task.scorer_spec(sample)}


def budget_clipped(variant: Variant | None, prompt: Prompt) -> bool | None:
    """True when a token budget exceeds the sample's context, so the variant keeps everything; None for the
    baseline."""
    if variant is None:
        return None
    return variant.policy.asked(prompt.n_context) > prompt.n_context
