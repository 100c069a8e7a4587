"""What evalkit's engine records of one decode: the row fields built from its Outcome (the run's rows, engine.hf, and
lm-eval's, evalkit.lmeval.model); the rows themselves are built by evalkit.records.pair."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from evalkit.contract import asked_tokens
from evalkit.engine import models
from evalkit.engine.engine import Outcome
from evalkit.kv.variant import Variant
from evalkit.records import BASELINE
from evalkit.tasks.prompt import Prompt


def prediction_text(loaded: models.LoadedModel, outcome: Outcome) -> str:
    return loaded.tokenizer.decode(outcome.tokens, skip_special_tokens=True).strip()


def hf_engine() -> dict[str, str]:
    """What every row of evalkit's own engine says produced it: rows name their backend."""
    return {"backend": "hf", "engine_version": f"transformers {transformers.__version__}, torch {torch.__version__}"}


def kv_fields(outcome: Outcome, variant: Variant | None, n_context: int) -> dict[str, Any]:
    """The KV record of one decode (the baseline's when `variant` is None) after a context of n_context tokens:
    bytes held, peaks, tokens per layer and how the context was prefilled. One schema for the run's rows and
    lm-eval's (evalkit.lmeval.model)."""
    chunk = variant.chunk if variant is not None else None
    return {
        # what ran: the policy's class and resolved settings, which the variant's label derives from
        "policy": variant.record() if variant is not None else {"name": BASELINE},
        "quant": variant.quant_record() if variant is not None else None,
        "kv_bytes": outcome.kv_bytes,
        "kv_bytes_fp16_same_tokens": outcome.kv_bytes_fp16,
        # as a deployment holds them (fp16/bf16 dense, quantized packed): what ratios, the gate and capacity use
        "kv_bytes_deployed": outcome.kv_bytes_deployed,
        "attention_path": outcome.attention_path,
        "kv_bytes_final": outcome.kv_bytes_final,
        "peak_kv_bytes": outcome.peak_kv_bytes,
        # the cache the answer was decoded from, as deployed, at its largest: the compressed context, the question
        # and every generated token (before each eviction); what min_compression and every ratio shown judge
        "decode_peak_kv_bytes_deployed": outcome.decode_peak_kv_bytes_deployed,
        "prefill": {"mode": "chunked", "chunk": chunk} if chunk else {"mode": "oneshot"},
        "prefill_peak_kv_bytes": outcome.prefill_peak_kv_bytes,
        "prefill_peak_tokens": outcome.prefill_peak_tokens,
        # what a chunked prefill promises: an evicting layer never holds more than its final budget plus one chunk
        "prefill_bound_tokens": variant.policy.target(n_context) + chunk if chunk else None,
        "tokens_held_per_layer": outcome.tokens_held,
        "tokens_allocated_per_layer": outcome.tokens_allocated,
        "tokens_allowed_per_layer": outcome.tokens_allowed,
        "context_tokens": n_context,
        # whether the policy asks for a smaller cache (KVPolicy.compresses): the gate holds its bytes to it
        "compression_asked": variant is not None and variant.policy.compresses(),
    }


def baseline_fields(baseline: Outcome) -> dict[str, int]:
    """The baseline's bytes on the same context, carried by every row of a sample."""
    return {
        "kv_bytes_baseline": baseline.kv_bytes,
        "kv_bytes_baseline_deployed": baseline.kv_bytes_deployed,
        "decode_peak_kv_bytes_baseline_deployed": baseline.decode_peak_kv_bytes_deployed,
    }


def budget_clipped(variant: Variant | None, prompt: Prompt) -> bool | None:
    """True when a token budget exceeds the sample's context, so the variant keeps everything; None for the
    baseline."""
    if variant is None:
        return None
    return asked_tokens(variant.policy.budget, prompt.n_context) > prompt.n_context
