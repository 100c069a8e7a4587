"""One evalkit run: validate, load, then for each sample the baseline and every variant, rows written as they finish."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evalkit import interrupt, models
from evalkit.analysis import BASELINE, format_summary, summarize
from evalkit.config import validate
from evalkit.config import variants as configured_variants
from evalkit.engine import Outcome, Variant, run_sample
from evalkit.errors import ConfigError
from evalkit.fidelity import fidelity
from evalkit.prompt import Prompt, build_prompt
from evalkit.records import (
    RUN,
    SAMPLES,
    SUMMARY,
    RecordWriter,
    config_differences,
    read_rows,
    versions,
    write_json,
)
from evalkit.tasks import Sample, Task


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run the configured task with the baseline and the configured policy; return the summary."""
    task: Task = instantiate(cfg.task, _convert_="all")
    variants = configured_variants(cfg)
    validate(cfg, task, [v.policy for v in variants])
    if task.external and any(v.chunk for v in variants):
        raise ConfigError(f"task={task.name}: lm-eval drives its own forwards, so prefill=chunked is not supported")

    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / SAMPLES
    config = OmegaConf.to_container(cfg, resolve=True)
    run_info = _start(out_dir, config, bool(cfg.resume))
    done = {(r["sample_id"], r["variant"]) for r in read_rows(rows_path, repair=True)}

    if interrupt.requested():  # a sweep's job that starts after Ctrl-C
        raise interrupt.Interrupted(f"stopped before {out_dir} started")
    _check_attention(cfg, variants)
    torch.manual_seed(int(cfg.seed))
    loaded = models.load(cfg.model, cfg.device)
    _check_model(run_info, loaded)
    run_info["model"] = {
        "name": loaded.name,
        "fingerprint": loaded.fingerprint,
        "weights_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "source": loaded.source,
        "load_seconds": round(loaded.load_seconds, 3),
    }
    write_json(out_dir / RUN, run_info)

    if task.external:
        _run_external(task, loaded, variants, run_info, rows_path, done, cfg)
        return _finish(rows_path, out_dir)
    names = [BASELINE] + [v.name for v in variants]
    samples = task.samples(loaded.tokenizer)
    pending = [s for s in samples if any((s.id, n) not in done for n in names)]
    if done:
        print(f"evalkit: resuming {out_dir}: {len(samples) - len(pending)} of {len(samples)} samples already done")
    stop_ids = _stop_ids(loaded)
    limit = models.max_context(cfg.model)  # read once: for an hf model it reads its config
    writer = RecordWriter(rows_path)
    try:
        for sample in tqdm(pending, desc=f"{task.name} x {', '.join(names[1:])}", unit="sample", file=sys.stderr):
            if interrupt.requested():
                left = len(pending) - pending.index(sample)
                raise interrupt.Interrupted(f"stopped: {left} of {len(samples)} samples left to run in {out_dir}")
            prompt = build_prompt(loaded.tokenizer, sample, cfg.protocol)
            check_sample(sample, prompt, limit, cfg, task, variants)
            baseline, outcomes = run_sample(
                loaded.model, prompt, variants, task.max_new_tokens, stop_ids, forced=task.teacher_forced
            )
            results = score_outcomes(loaded, task, sample, prompt, baseline, outcomes)
            for variant, outcome, (score, base_score, extra) in zip(
                [None, *variants], [baseline, *outcomes], results, strict=True
            ):
                if (sample.id, outcome.variant) not in done:
                    row = _row(run_info, task, sample, prompt, outcome, baseline, loaded, variant, cfg.protocol)
                    writer.write(
                        {
                            **row,
                            **extra,
                            "score": score,
                            "baseline_score": base_score,
                            "flip": flip(score, base_score) if not task.teacher_forced else None,
                        }
                    )
    finally:
        writer.close()

    return _finish(rows_path, out_dir)


def _finish(rows_path: Path, out_dir: Path) -> dict[str, Any]:
    summary = summarize(read_rows(rows_path))
    write_json(out_dir / SUMMARY, summary)
    print(format_summary(summary))
    print(f"\nrecords: {rows_path}")
    return summary


def _run_external(task, loaded, variants, run_info, rows_path: Path, done: set, cfg: DictConfig) -> None:
    """lm-eval tasks: lm-eval drives the requests; evalkit records one row per document and variant."""
    from evalkit import lmeval

    with interrupt.immediate():  # lm-eval runs every request in one call: Ctrl-C stops it at once
        rows, results = lmeval.evaluate(task, loaded, variants)
    write_json(rows_path.parent / "lm_eval_results.json", results)
    writer = RecordWriter(rows_path)
    try:
        for row in rows:
            if (row["sample_id"], row["variant"]) not in done:
                writer.write(
                    {
                        "run_id": run_info["run_id"],
                        "task": task.name,
                        "protocol": cfg.protocol,
                        "flip": flip(row["score"], row["baseline_score"]),
                        "peak_kv_bytes": row.get("kv_bytes"),
                        **row,
                    }
                )
    finally:
        writer.close()


def score_outcomes(loaded, task: Task, sample: Sample, prompt: Prompt, baseline: Outcome, outcomes: list[Outcome]):
    """(score, baseline score, extra row fields) for the baseline, then each variant.

    Generated answers are scored by the task; teacher-forced continuations by their fidelity to the baseline's
    logits (score = top-1 agreement, so the baseline scores 1).
    """
    if task.teacher_forced:
        targets = prompt.ids[0, prompt.n_context + 1 :].tolist()
        return [
            (m["top1_agreement"], 1.0, m)
            for m in (fidelity(baseline.logits, o.logits, targets) for o in [baseline, *outcomes])
        ]
    base_score = task.score(_text(loaded, baseline), sample)
    return [(base_score, base_score, {})] + [(task.score(_text(loaded, o), sample), base_score, {}) for o in outcomes]


def flip(score: float, base_score: float) -> str | None:
    """`lost` when the variant scores below the baseline on the sample, `gained` above, None when equal."""
    return None if score == base_score else ("lost" if score < base_score else "gained")


def check_sample(
    sample: Sample, prompt: Prompt, limit: int, cfg: DictConfig, task: Task, variants: list[Variant]
) -> None:
    """What only a tokenized sample can tell: does it fit the model (`limit` tokens), can every budget hold on it?"""
    need = int(prompt.ids.shape[1]) + task.max_new_tokens
    if need > limit:
        raise ConfigError(
            f"sample {sample.id!r}: {prompt.ids.shape[1]} prompt tokens + {task.max_new_tokens} to "
            f"generate exceed {cfg.model.name}'s {limit}; shorten its context"
        )
    for v in variants:
        v.check(prompt.n_context, f"sample {sample.id!r}")


READ_ONLY = ("gate", "logger")


def _start(out_dir: Path, config: dict, resume: bool) -> dict[str, Any]:
    """Create run.json, or check that the run being resumed had the same config and versions."""
    rows_path, run_path = out_dir / SAMPLES, out_dir / RUN
    comparable = {k: v for k, v in config.items() if k != "resume"}
    has_rows = rows_path.exists() and rows_path.stat().st_size > 0
    if has_rows and not resume:
        raise ConfigError(
            f"{out_dir} already holds results of an earlier run; add resume=true to continue it, "
            "or choose a new folder with hydra.run.dir=... (nothing was overwritten)"
        )
    now = versions()
    if resume and run_path.exists():
        old = json.loads(run_path.read_text())
        # the gate and the logger read the records, they do not change them: a resumed run may use others
        diffs = config_differences(
            *({k: v for k, v in c.items() if k not in READ_ONLY} for c in (old["config"], comparable))
        )
        diffs += [
            f"versions.{k}: {old['versions'].get(k)!r} -> {now[k]!r}"
            for k in ("torch", "transformers")
            if old["versions"].get(k) != now[k]
        ]
        if diffs:
            raise ConfigError(f"resume=true, but this run differs from the one in {out_dir}: {'; '.join(diffs)}")
        old["resumed"] = [*old.get("resumed", []), time.strftime("%Y-%m-%dT%H:%M:%S")]
        return old
    info = {
        "run_id": uuid.uuid4().hex[:12],
        "config": comparable,
        "versions": now,
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "protocol": config["protocol"],
        "seed": config["seed"],
        "torch_threads": torch.get_num_threads(),
    }
    write_json(run_path, info)
    return info


def _check_attention(cfg: DictConfig, variants: list[Variant]) -> None:
    """Before the weights load: what needs evalkit's observed SDPA (attention scores, packed quantized history).
    Whether the implementation itself can run here, models.load checks."""
    impl = cfg.model.get("attn_implementation", "sdpa")
    needs = sorted({n for v in variants for n in v.policy.needs})
    if impl != "sdpa" and needs:
        raise ConfigError(
            f"the policies need {needs} observed in attention, which evalkit does through SDPA; "
            f"model.attn_implementation={impl!r}: use sdpa, or a policy that needs no scores (streaming_llm, knorm)"
        )
    quantized = [v.name for v in variants if v.quant is not None]
    if impl != "sdpa" and quantized:
        raise ConfigError(f"{quantized} attend over packed keys through SDPA: use model.attn_implementation=sdpa")


def _check_model(run_info: dict, loaded: models.LoadedModel) -> None:
    old = run_info.get("model", {}).get("fingerprint")
    if old is not None and old != loaded.fingerprint:
        raise ConfigError(f"resume=true, but the model weights changed ({old} -> {loaded.fingerprint})")


def _stop_ids(loaded: models.LoadedModel) -> set[int]:
    ids = {loaded.tokenizer.eos_token_id}
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list) else {eos}
    return {i for i in ids if i is not None}


def _text(loaded: models.LoadedModel, outcome: Outcome) -> str:
    return loaded.tokenizer.decode(outcome.tokens, skip_special_tokens=True).strip()


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
        "run_id": run_info["run_id"],
        "sample_id": sample.id,
        "task": task.name,
        "cell": sample.cell,
        "variant": outcome.variant,
        "policy": dataclasses.asdict(variant.policy) if variant is not None else {"name": BASELINE},
        "quant": dataclasses.asdict(variant.quant) if variant is not None and variant.quant else None,
        "protocol": protocol,
        "prediction": _text(loaded, outcome),
        "answers": sample.answers,
        "kv_bytes": outcome.kv_bytes,
        "kv_bytes_baseline": baseline.kv_bytes,
        "kv_bytes_fp16_same_tokens": outcome.kv_bytes_fp16,
        "kv_bytes_final": outcome.kv_bytes_final,
        "peak_kv_bytes": outcome.peak_kv_bytes,
        "prefill": {"mode": "chunked", "chunk": variant.chunk} if variant and variant.chunk else {"mode": "oneshot"},
        "prefill_peak_kv_bytes": outcome.prefill_peak_kv_bytes,
        "prefill_peak_tokens": outcome.prefill_peak_tokens,
        # what a chunked prefill promises: an evicting layer never holds more than its final budget plus one chunk
        "prefill_bound_tokens": variant.policy.target(prompt.n_context) + variant.chunk
        if variant and variant.chunk
        else None,
        "tokens_held_per_layer": outcome.tokens_held,
        "evidence_retained_per_layer": outcome.evidence_retained,
        "context_tokens": prompt.n_context,
        "prompt_tokens": int(prompt.ids.shape[1]),
        "generated_tokens": len(outcome.tokens),
        "seconds": {k: round(v, 4) for k, v in outcome.seconds.items()},
    }
