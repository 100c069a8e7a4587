"""One evalkit run: validate, build and check every sample, then the sample loop (evalkit.run.loop) over the engine
that answers them: evalkit's own, another (evalkit.backends), or lm-eval's driver."""

from __future__ import annotations

import sys
from typing import Any

import torch

from evalkit.engine import models
from evalkit.engine.rows import budget_clipped
from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant
from evalkit.lock import RunLock
from evalkit.records import RUN, SAMPLES, cut_torn, write_json
from evalkit.run import interrupt
from evalkit.run.loop import Engine, finish, job, run_samples
from evalkit.run.resume import check_samples_unchanged, check_written, start
from evalkit.runspec import RunSpec
from evalkit.tasks import Sample, Task
from evalkit.tasks.prompt import Prompt, build_prompt, prompt_text


def run(
    spec: RunSpec, task: Task, variants: tuple[Variant, ...], answering: Engine, stop: interrupt.Stop
) -> dict[str, Any]:
    """Run the spec's task with the baseline and its variants (built and checked by the command line,
    evalkit.cli.spec) into its folder, answered by `answering` (evalkit.run.loop.Engine: evalkit's own, another
    engine's, or lm-eval's driver, chosen by evalkit.cli.job), until `stop` is asked (the command's Ctrl-C, between
    samples); return the summary."""
    if task.external and any(v.chunk for v in variants):
        raise ConfigError(f"task={task.name}: lm-eval drives its own forwards, so prefill=chunked is not supported")
    _check_attention(spec, variants)
    print(f"evalkit: run folder: {spec.out_dir}")
    with RunLock(spec.out_dir):  # before evalkit writes anything there: one writer per folder
        return _run(spec, task, variants, answering, stop)


def _run(
    spec: RunSpec, task: Task, variants: tuple[Variant, ...], answering: Engine, stop: interrupt.Stop
) -> dict[str, Any]:
    out_dir = spec.out_dir
    rows_path = out_dir / SAMPLES
    run_info = start(out_dir, spec.plain_config(), spec.resume, task)
    cut_torn(rows_path)  # before anything loads: a line that is no row refused, a torn last one cut
    if stop.requested():  # a sweep's job that starts after Ctrl-C
        raise interrupt.Interrupted(f"stopped before {out_dir} started")
    torch.manual_seed(spec.seed)
    jobs = None  # lm-eval finds its own documents
    if not task.external:
        # The tokenizer loads before the weights: every sample is built and checked before any of them runs.
        tokenizer = models.load_tokenizer(spec.model)
        samples = task.samples(tokenizer)
        check_samples_unchanged(run_info, samples, out_dir)
        prompts = [build_prompt(tokenizer, s, spec.protocol) for s in samples]
        check_written(rows_path, task, samples, prompts)
        check_samples(samples, prompts, models.max_context(spec.model), spec.model.name, task, variants)
        write_json(out_dir / RUN, run_info.to_dict())
        # what a server is sent: the prompt as text
        texts = {s.id: prompt_text(tokenizer, s)[0] for s in samples} if spec.engine != "hf" else {}
        jobs = [job(task, s, p, texts.get(s.id, "")) for s, p in zip(samples, prompts, strict=True)]
    run_samples(answering, out_dir, run_info, task, jobs, stop)
    summary = finish(out_dir)
    print(f"\nrecords: {rows_path}")
    return summary


def check_samples(
    samples: list[Sample], prompts: list[Prompt], limit: int, model: str, task: Task, variants: tuple[Variant, ...]
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
            f"{len(too_long)} sample(s) need more tokens (prompt + answer) than {model}'s {limit}: "
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


def _check_attention(spec: RunSpec, variants: tuple[Variant, ...]) -> None:
    """Before the weights load: what needs evalkit's observed SDPA (attention scores, packed quantized history).
    Whether the implementation itself can run here, models.load checks."""
    impl = spec.model.attn_implementation
    needs = sorted({str(o) for v in variants for o in v.policy.needs()})
    if impl != "sdpa" and needs:
        raise ConfigError(
            f"the policies need {needs} observed in attention, which evalkit does through SDPA; "
            f"model.attn_implementation={impl!r}: use sdpa, or a policy that needs no scores (streaming_llm, knorm)"
        )
    quantized = [v.name for v in variants if v.quant is not None]
    if impl != "sdpa" and quantized:
        raise ConfigError(f"{quantized} attend over packed keys through SDPA: use model.attn_implementation=sdpa")
