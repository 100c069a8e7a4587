"""One evalkit run: validate, load, then for each sample the baseline and every variant, rows written as they finish."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from evalkit import interrupt, models
from evalkit.analysis import BASELINE, format_summary, summarize
from evalkit.config import build, validate
from evalkit.config import variants as configured_variants
from evalkit.engine import Outcome, Variant, run_sample
from evalkit.errors import ConfigError
from evalkit.fidelity import fidelity
from evalkit.lock import RunLock
from evalkit.models import file_sha256
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
    task: Task = build(cfg.task, "task")
    variants = configured_variants(cfg)
    validate(cfg, task, [v.policy for v in variants])
    if task.external and any(v.chunk for v in variants):
        raise ConfigError(f"task={task.name}: lm-eval drives its own forwards, so prefill=chunked is not supported")
    _check_attention(cfg, variants)
    print(f"evalkit: run folder: {out_dir}")
    with RunLock(out_dir):  # before evalkit writes anything there: one writer per folder
        return _run(cfg, out_dir, task, variants)


def _run(cfg: DictConfig, out_dir: Path, task: Task, variants: list[Variant]) -> dict[str, Any]:
    rows_path = out_dir / SAMPLES
    config = OmegaConf.to_container(cfg, resolve=True)
    run_info = _start(out_dir, config, bool(cfg.resume), task)
    done = {(r["sample_id"], r["variant"]) for r in read_rows(rows_path, repair=True)}

    if interrupt.requested():  # a sweep's job that starts after Ctrl-C
        raise interrupt.Interrupted(f"stopped before {out_dir} started")
    torch.manual_seed(int(cfg.seed))
    if not task.external:
        # The tokenizer loads before the weights: every sample is built and checked before any of them runs.
        tokenizer = models.load_tokenizer(cfg.model)
        samples = task.samples(tokenizer)
        _check_samples_unchanged(run_info, samples, out_dir)
        prompts = [build_prompt(tokenizer, s, cfg.protocol) for s in samples]
        check_samples(samples, prompts, models.max_context(cfg.model), cfg, task, variants)
        write_json(out_dir / RUN, run_info)
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
    prepared = prepare_policies(variants, loaded)
    if prepared:
        run_info["prepared"] = prepared
    write_json(out_dir / RUN, run_info)

    if task.external:
        _run_external(task, loaded, variants, run_info, rows_path, done, cfg)
        return _finish(rows_path, out_dir)
    names = [BASELINE] + [v.name for v in variants]
    pending = [(s, p) for s, p in zip(samples, prompts, strict=True) if any((s.id, n) not in done for n in names)]
    if done:
        print(f"evalkit: resuming {out_dir}: {len(samples) - len(pending)} of {len(samples)} samples already done")
    stop_ids = _stop_ids(loaded)
    contexts = [_context_key(p) for _, p in pending]
    shared = None
    writer = RecordWriter(rows_path)
    try:
        for i, (sample, prompt) in enumerate(
            tqdm(pending, desc=f"{task.name} x {', '.join(names[1:])}", unit="sample", file=sys.stderr)
        ):
            if interrupt.requested():
                raise interrupt.Interrupted(
                    f"stopped: {len(pending) - i} of {len(samples)} samples left to run in {out_dir}"
                )
            if i == 0 or contexts[i] != contexts[i - 1]:  # one prefill and compression for the questions on a context
                shared = {} if contexts[i + 1 : i + 2] == [contexts[i]] else None
            baseline, outcomes = run_sample(
                loaded.model,
                prompt,
                variants,
                task.answer_tokens(sample),
                stop_ids,
                forced=task.teacher_forced,
                shared=shared,
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


def prepare_policies(variants: list[Variant], loaded) -> dict[str, dict]:
    """Let each policy learn what it needs from the loaded model (KVPolicy.prepare); what they report, timed, by
    variant name."""
    prepared = {}
    for v in variants:
        t = time.perf_counter()
        info = v.policy.prepare(loaded.model, loaded.tokenizer)
        if info is not None:
            prepared[v.name] = {**info, "seconds": round(time.perf_counter() - t, 3)}
    return prepared


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


def check_samples(
    samples: list[Sample], prompts: list[Prompt], limit: int, cfg: DictConfig, task: Task, variants: list[Variant]
) -> None:
    """What only tokenized samples can tell, for all of them before any runs: does each fit the model (`limit`
    tokens), can every budget hold on it? A budget larger than a sample's context is run as the full context and
    said here (rows record it as `budget_clipped`)."""
    too_long = [
        f"{s.id!r} ({p.ids.shape[1]} + {task.answer_tokens(s)})"
        for s, p in zip(samples, prompts, strict=True)
        if int(p.ids.shape[1]) + task.answer_tokens(s) > limit
    ]
    if too_long:
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        raise ConfigError(
            f"{len(too_long)} sample(s) need more tokens (prompt + answer) than {cfg.model.name}'s {limit}: "
            f"{', '.join(too_long[:5])}{more}; shorten their contexts (nothing was run)"
        )
    for s, p in zip(samples, prompts, strict=True):
        for v in variants:
            v.check(p.n_context, f"sample {s.id!r}")
    for v in variants:
        clipped = [p.n_context for p in prompts if budget_clipped(v, p)]
        if clipped:
            print(
                f"evalkit: warning: {v.name} asks for more tokens than {len(clipped)} of {len(prompts)} samples hold "
                f"(shortest context {min(clipped)} tokens): those keep their whole context, at 1.0x; their rows "
                "say budget_clipped",
                file=sys.stderr,
            )


def budget_clipped(variant: Variant | None, prompt: Prompt) -> bool | None:
    """True when a token budget exceeds the sample's context, so the variant keeps everything; None for the
    baseline."""
    if variant is None:
        return None
    return variant.policy.asked(prompt.n_context) > prompt.n_context


# The gate and the logger read the records, they do not change them, and results_root is where the folder lies,
# not what it measured: a resumed run may differ in them (a copied or moved folder resumes).
NOT_IDENTITY = ("resume", "gate", "logger", "results_root")
# How many samples a task generates is not part of the identity either: samples are generated the same whatever the
# count, and their digests prove it (_check_samples_unchanged), so resume=true with a larger count extends a run.
SAMPLE_COUNT = ("samples_per_cell",)


def _identity(config: dict) -> dict:
    out = {k: v for k, v in config.items() if k not in NOT_IDENTITY}
    if isinstance(out.get("task"), dict):
        out["task"] = {k: v for k, v in out["task"].items() if k not in SAMPLE_COUNT}
    return out


def _start(out_dir: Path, config: dict, resume: bool, task: Task) -> dict[str, Any]:
    """Create run.json, or prove that the run being resumed is the same experiment: same config, library versions
    and input files (sha256); the samples and the weights are compared once they are known (_check_samples_unchanged,
    _check_model)."""
    rows_path, run_path = out_dir / SAMPLES, out_dir / RUN
    comparable = {k: v for k, v in config.items() if k != "resume"}
    has_rows = rows_path.exists() and rows_path.stat().st_size > 0
    if has_rows and not resume:
        raise ConfigError(
            f"{out_dir} already holds results of an earlier run; add resume=true to continue it, "
            "or choose a new folder with hydra.run.dir=... (nothing was overwritten)"
        )
    now = versions()
    files = {str(f): file_sha256(Path(f)) for f in _input_files(task)}
    if has_rows and not run_path.exists():
        raise ConfigError(
            f"{rows_path} holds rows but {run_path.name} is missing, so nothing proves they come from this "
            "experiment; restore run.json, or move the folder away to start afresh"
        )
    if resume and run_path.exists():
        old = _read_run_json(run_path)
        diffs = config_differences(_identity(old["config"]), _identity(comparable))
        diffs += [
            f"versions.{k}: {old['versions'].get(k)!r} -> {now[k]!r}"
            for k in ("torch", "transformers")
            if old["versions"].get(k) != now[k]
        ]
        old_files = (old.get("data") or {}).get("files", {})
        diffs += [
            f"data file {Path(f).name} changed (sha256 {old_files.get(f, 'none')[:12]} -> {h[:12]})"
            for f, h in files.items()
            if old_files.get(f) != h
        ]
        if diffs:
            raise ConfigError(
                f"resume=true, but this run differs from the one in {out_dir}: {'; '.join(diffs)}; the rows there "
                "answer the old experiment: run this one in a new folder"
            )
        old["resumed"] = [*old.get("resumed", []), time.strftime("%Y-%m-%dT%H:%M:%S")]
        old["config"] = comparable  # the sample count may have grown
        return old
    info = {
        "run_id": uuid.uuid4().hex[:12],
        "config": comparable,
        "versions": now,
        "data": {"files": files},
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "protocol": config["protocol"],
        "seed": config["seed"],
        "torch_threads": torch.get_num_threads(),
    }
    write_json(run_path, info)
    return info


def _input_files(task: Task) -> list[str]:
    """The files a task reads its samples from (JSONL data), whose bytes are part of the run's identity."""
    if hasattr(task, "input_files"):  # task=hf: a file, a folder's data files, or none for a Hub id
        return task.input_files()
    path = getattr(task, "path", "")
    return [str(Path(path).resolve())] if path else []


def _read_run_json(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(
            f"{path} cannot be read ({err}); the run cannot be resumed: move the folder away to start afresh"
        ) from None
    if not isinstance(info, dict) or not isinstance(info.get("config"), dict) or "run_id" not in info:
        raise ConfigError(f"{path} is not an evalkit run.json; move the folder away to start afresh")
    info.setdefault("versions", {})
    return info


def sample_digest(sample: Sample) -> str:
    """sha256 of everything a sample feeds the model and is scored against."""
    fields = dataclasses.asdict(sample)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _check_samples_unchanged(run_info: dict[str, Any], samples: list[Sample], out_dir: Path) -> None:
    """Record each sample's digest; on resume, refuse when the task now generates other samples than the rows
    already written answer. New samples beside unchanged old ones (a larger task.samples_per_cell) extend the run."""
    now = {s.id: sample_digest(s) for s in samples}
    data = run_info.setdefault("data", {})
    old = data.get("samples")
    if old is not None and old != now:
        changed = sorted(i for i in set(old) & set(now) if old[i] != now[i])
        gone, new = set(old) - set(now), set(now) - set(old)
        if changed or gone:
            parts = [
                f"{len(changed)} changed (e.g. {changed[0]!r})" if changed else "",
                f"{len(new)} new" if new else "",
                f"{len(gone)} gone" if gone else "",
            ]
            raise ConfigError(
                f"resume=true, but the task's samples differ from those of the run in {out_dir}: "
                f"{', '.join(p for p in parts if p)} of {len(old)}; the rows there answer the old samples: "
                "run the new data in a new folder"
            )
        print(f"evalkit: extending {out_dir}: {len(old)} samples done before, {len(new)} new")
        data["extended"] = [*data.get("extended", []), {"from": len(old), "to": len(now)}]
    data["samples"] = now


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


def _context_key(prompt: Prompt) -> bytes:
    """The ids a prompt prefills and compresses: prompts with the same key share one prefill (run_sample's shared)."""
    return prompt.ids[0, : prompt.n_context].numpy().tobytes()


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
        # as a deployment holds them (fp16/bf16 dense, quantized packed): what ratios, the gate and capacity use
        "kv_bytes_deployed": outcome.kv_bytes_deployed,
        "kv_bytes_baseline_deployed": baseline.kv_bytes_deployed,
        "attention_path": outcome.attention_path,
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
        "tokens_allocated_per_layer": outcome.tokens_allocated,
        "evidence_retained_per_layer": outcome.evidence_retained,
        "budget_clipped": budget_clipped(variant, prompt),
        "context_tokens": prompt.n_context,
        "prompt_tokens": int(prompt.ids.shape[1]),
        "generated_tokens": len(outcome.tokens),
        "seconds": {k: round(v, 4) for k, v in outcome.seconds.items()},
        # decoded in one batch with this many caches (its seconds.decode a share of the batch's); or not decoded at
        # all: the variant named kept the same tokens, stored alike, and its decode is this row's (evalkit.outcome)
        "decode_batch": outcome.decode_batch,
        "decoded_like": outcome.decoded_like,
        **task.row_fields(sample),  # what a task records of each sample beyond these (task=hf: its truncation)
    }
