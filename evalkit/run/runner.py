"""One evalkit run: validate, load, then for each sample the baseline and every variant, rows written as they finish."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from evalkit.backends import Backend
from evalkit.backends.loop import run_backend
from evalkit.errors import ConfigError
from evalkit.gate.evidence import flip
from evalkit.gate.summary import BASELINE, format_summary, summarize
from evalkit.kv import contract
from evalkit.kv.variant import Variant
from evalkit.lock import RunLock
from evalkit.records import (
    RUN,
    SAMPLES,
    SUMMARY,
    RecordWriter,
    read_rows,
    write_json,
)
from evalkit.run import interrupt, models
from evalkit.run.divergence import logit_divergence
from evalkit.run.engine import Outcome, compress_context, decode
from evalkit.run.probes import NeedleProbes
from evalkit.run.resume import _check_model, _check_samples_unchanged, _start, check_written
from evalkit.run.rows import _row, budget_clipped, header, prediction_text
from evalkit.tasks import Sample, Task
from evalkit.tasks.prompt import Prompt, build_prompt, prompt_text

if TYPE_CHECKING:
    from evalkit.cli.spec import RunSpec


def run(spec: RunSpec) -> dict[str, Any]:
    """Run the spec's task with the baseline and its variants (built and checked by the command line,
    evalkit.cli.spec) into its folder, or through another engine (its `engine`: evalkit.backends); return the
    summary."""
    out_dir, task, variants, engine = spec.out_dir, spec.task, list(spec.variants), spec.engine
    if task.external and any(v.chunk for v in variants):
        raise ConfigError(f"task={task.name}: lm-eval drives its own forwards, so prefill=chunked is not supported")
    _check_attention(spec, variants)
    print(f"evalkit: run folder: {out_dir}")
    with RunLock(out_dir):  # before evalkit writes anything there: one writer per folder
        return _run(spec, out_dir, task, variants, engine)


def _run(
    spec: RunSpec, out_dir: Path, task: Task, variants: list[Variant], engine: Backend | None = None
) -> dict[str, Any]:
    rows_path = out_dir / SAMPLES
    run_info = _start(out_dir, spec.config, spec.resume, task)
    done = {(r["sample_id"], r["variant"]) for r in read_rows(rows_path, repair=True)}
    if interrupt.requested():  # a sweep's job that starts after Ctrl-C
        raise interrupt.Interrupted(f"stopped before {out_dir} started")
    torch.manual_seed(spec.seed)
    if not task.external:
        # The tokenizer loads before the weights: every sample is built and checked before any of them runs.
        tokenizer = models.load_tokenizer(spec.model)
        samples = task.samples(tokenizer)
        _check_samples_unchanged(run_info, samples, out_dir)
        prompts = [build_prompt(tokenizer, s, spec.protocol) for s in samples]
        check_written(rows_path, task, samples, prompts)
        check_samples(samples, prompts, models.max_context(spec.model), spec, task, variants)
        write_json(out_dir / RUN, run_info)
    if engine is not None:  # another engine produces the outcomes (evalkit.backends.loop)
        texts = {s.id: prompt_text(tokenizer, s)[0] for s in samples}  # what a server is sent
        run_backend(engine, spec.backend, run_info, task, samples, prompts, texts, rows_path)
        return _finish(rows_path, out_dir)
    loaded = models.load(spec.model, spec.device)
    _check_model(run_info, loaded)
    run_info["model"] = loaded.info()
    prepared = prepare_policies(variants, loaded)
    if prepared:
        run_info["prepared"] = prepared
    write_json(out_dir / RUN, run_info)
    if task.external:
        _run_external(task, loaded, variants, run_info, rows_path, done, spec)
    else:
        _run_samples(spec, out_dir, task, variants, loaded, run_info, list(zip(samples, prompts, strict=True)), done)
    return _finish(rows_path, out_dir)


def _run_samples(
    spec: RunSpec, out_dir: Path, task: Task, variants: list[Variant], loaded, run_info: dict, work, done: set
):
    """Every sample not yet done: the baseline and each variant from one prefill, rows written as each finishes."""
    names = [BASELINE] + [v.name for v in variants]
    pending = [(s, p) for s, p in work if any((s.id, n) not in done for n in names)]
    if done:
        print(f"evalkit: resuming {out_dir}: {len(work) - len(pending)} of {len(work)} samples already done")
    stop_ids = _stop_ids(loaded)
    contexts = [p.context_ids for _, p in pending]
    writer = RecordWriter(out_dir / SAMPLES)
    try:
        for i, (sample, prompt) in enumerate(
            tqdm(pending, desc=f"{task.name} x {', '.join(names[1:])}", unit="sample", file=sys.stderr)
        ):
            if interrupt.requested():
                raise interrupt.Interrupted(
                    f"stopped: {len(pending) - i} of {len(work)} samples left to run in {out_dir}"
                )
            ids = prompt.ids.to(loaded.model.device)
            if i == 0 or contexts[i] != contexts[i - 1]:  # one prefill and compression for the questions on a context
                compressed = compress_context(loaded.model, ids[:, : prompt.n_context], variants, prompt.repeat)
            baseline, outcomes = decode(
                loaded.model, compressed, ids[:, prompt.n_context :], task.answer_tokens(sample), stop_ids,
                forced=task.teacher_forced, evidence=prompt.evidence,
            )  # fmt: skip
            results = score_outcomes(loaded, task, sample, prompt, baseline, outcomes)
            rows = []
            for variant, outcome, (score, base_score, extra) in zip(
                [None, *variants], [baseline, *outcomes], results, strict=True
            ):
                if (sample.id, outcome.variant) not in done:
                    row = _row(run_info, task, sample, prompt, outcome, baseline, loaded, variant, spec.protocol)
                    fields = {"score": score, "baseline_score": base_score}
                    fields["flip"] = flip(score, base_score) if not task.teacher_forced else None
                    rows.append({**row, **extra, **fields})
            writer.write(*rows)  # the sample's rows whole
    finally:
        writer.close()


def prepare_policies(variants: list[Variant], loaded) -> dict[str, dict]:
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


def _finish(rows_path: Path, out_dir: Path) -> dict[str, Any]:
    summary = summarize(read_rows(rows_path))
    write_json(out_dir / SUMMARY, summary)
    print(format_summary(summary))
    print(f"\nrecords: {rows_path}")
    return summary


def _run_external(task, loaded, variants, run_info, rows_path: Path, done: set, spec: RunSpec) -> None:
    """lm-eval tasks: lm-eval drives the requests; evalkit records one row per document and variant."""
    from evalkit.lmeval.evaluate import evaluate

    with interrupt.immediate():  # lm-eval runs every request in one call: Ctrl-C stops it at once
        rows, results = evaluate(task, loaded, variants)
    write_json(rows_path.parent / "lm_eval_results.json", results)
    writer = RecordWriter(rows_path)
    try:
        for row in rows:
            if (row["sample_id"], row["variant"]) not in done:
                writer.write(
                    {
                        **header(run_info, task.name, spec.protocol),
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
            for m in (logit_divergence(baseline.logits, o.logits, targets) for o in [baseline, *outcomes])
        ]
    base_score = task.score(prediction_text(loaded, baseline), sample)
    scores = [task.score(prediction_text(loaded, o), sample) for o in outcomes]
    return [(base_score, base_score, {})] + [(score, base_score, {}) for score in scores]


def check_samples(
    samples: list[Sample], prompts: list[Prompt], limit: int, spec: RunSpec, task: Task, variants: list[Variant]
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
            f"{len(too_long)} sample(s) need more tokens (prompt + answer) than {spec.model.name}'s {limit}: "
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


def _check_attention(spec: RunSpec, variants: list[Variant]) -> None:
    """Before the weights load: what needs evalkit's observed SDPA (attention scores, packed quantized history).
    Whether the implementation itself can run here, models.load checks."""
    impl = spec.model.attn_implementation
    needs = sorted({n for v in variants for n in v.policy.needs})
    if impl != "sdpa" and needs:
        raise ConfigError(
            f"the policies need {needs} observed in attention, which evalkit does through SDPA; "
            f"model.attn_implementation={impl!r}: use sdpa, or a policy that needs no scores (streaming_llm, knorm)"
        )
    quantized = [v.name for v in variants if v.quant is not None]
    if impl != "sdpa" and quantized:
        raise ConfigError(f"{quantized} attend over packed keys through SDPA: use model.attn_implementation=sdpa")


def _stop_ids(loaded: models.LoadedModel) -> set[int]:
    ids = {loaded.tokenizer.eos_token_id}
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, list) else {eos}
    return {i for i in ids if i is not None}
