"""The sample loop, one for every engine: evalkit's own (evalkit.engine.hf), llama.cpp and OpenAI-compatible servers
(evalkit.backends) and lm-eval's driver (evalkit.lmeval.evaluate) each turn a Job into Results; resume, Ctrl-C,
the rows written, the progress bar and the summary are here, once.

Resume skips the (sample, variant) rows already written, runs the baseline again for each sample a variant still
needs, and refuses a baseline that now answers otherwise. Rows are paired with the baseline and written as each
sample finishes (evalkit.records.pair, RecordWriter). The caller holds the folder's lock (evalkit.lock.RunLock).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Generator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol, TextIO

from tqdm import tqdm

from evalkit.errors import ConfigError
from evalkit.records import (
    BASELINE,
    RUN,
    SAMPLES,
    SUMMARY,
    Job,
    RecordWriter,
    Result,
    RunInfo,
    pair,
    read_rows,
    write_json,
)
from evalkit.records.summary import format_summary, summarize
from evalkit.run import interrupt
from evalkit.tasks import Sample, Task
from evalkit.tasks.prompt import Prompt


class Engine(Protocol):
    """What the sample loop asks of an engine."""

    # what rows record as their protocol; None: the run's (evalkit's protocols say which tokens its engine compresses)
    protocol: str | None
    # False: the engine runs every sample in one call (lm-eval), which Ctrl-C stops at once, not between samples
    interruptible: bool

    def variant_names(self) -> list[str]:
        """The variants' names, as rows record them (the baseline is `baseline`)."""

    def open(self, jobs: list[Job]) -> dict[str, Any]:
        """Load the engine or reach the servers, and refuse (ConfigError) what cannot give a fair comparison; return
        what run.json records of it (RunInfo fields: `model`, `engine`, `prepared`)."""

    def run(self, jobs: list[Job]) -> Generator[tuple[Job, list[Result]]]:
        """Each job's Results, the baseline's first, as they finish (an engine that finds its own jobs, lm-eval,
        yields them all whatever `jobs` holds)."""

    def close(self) -> None:
        """Free the engine or the connections."""


def job(task: Task, sample: Sample, prompt: Prompt, text: str = "") -> Job:
    """The job of one of a task's samples: what each of its rows records of it, and what an engine runs."""
    row = {
        "sample_id": sample.id,
        "cell": sample.cell,
        "question": sample.question,  # what was asked of the context: the report shows it beside a lost sample
        "answers": sample.answers,
        # the scorer of a generated answer (evalkit.scoring.spec), with which the gate and resume score it again;
        # none for a teacher-forced row (scored from logits)
        **({} if task.teacher_forced else {"scorer": task.scorer_spec(sample)}),
        "context_id": prompt.context_id,  # the compressed context: questions answered from one prefill share it
        "document_id": prompt.document_id,  # the text before the question: the gate's unit, whatever the protocol
        "prompt_tokens": int(prompt.ids.shape[1]),
        "context_tokens": prompt.n_context,
        **task.row_fields(sample),  # what a task records of each sample beyond these (task=hf: its truncation)
    }
    ids = prompt.ids[0].tolist()
    return Job(sample.id, row, [], sample, prompt, ids, text, task.answer_tokens(sample))


def run_samples(
    engine: Engine, out_dir: Path, run_info: RunInfo, task: Task, jobs: list[Job] | None, stop: interrupt.Stop
) -> None:
    """Let `engine` answer every job whose rows are missing (all of them: None, the engine finds its own) and write
    the rows, paired with the baseline, as each finishes, until `stop` is asked (the command's Ctrl-C)."""
    rows_path = out_dir / SAMPLES
    recorded = {(r.sample_id, r.variant): r for r in read_rows(rows_path)}
    names = [BASELINE, *engine.variant_names()]
    pending = []
    for j in jobs or []:
        todo = [n for n in names[1:] if (j.sample_id, n) not in recorded]
        if todo or (j.sample_id, BASELINE) not in recorded:
            pending.append(dataclasses.replace(j, variants=todo))
    if jobs and recorded:
        print(f"evalkit: resuming {out_dir}: {len(jobs) - len(pending)} of {len(jobs)} samples already done")
    try:
        opened = engine.open(pending)
        check_engine(run_info, opened)
        run_info.update(opened)
        write_json(out_dir / RUN, run_info.to_dict())
        head = run_info.head(task.name, engine.protocol)
        _write(engine, pending, None if jobs is None else len(jobs), recorded, rows_path, head, task, stop)
    finally:
        engine.close()


def _write(
    engine: Engine,
    pending: list[Job],
    total: int | None,
    recorded: dict,
    rows_path: Path,
    head: dict,
    task: Task,
    stop: interrupt.Stop,
) -> None:
    """The engine's answers to `pending` (of `total` samples; None: the engine finds its own), paired and written
    as each sample finishes; a stop asked for (Ctrl-C) is honoured before the next sample."""
    where = rows_path.parent
    progress = tqdm(
        total=len(pending) if total is not None else None,
        desc=f"{task.name} x {', '.join(engine.variant_names())}",
        unit="sample",
        file=sys.stderr,
    )
    writer = RecordWriter(rows_path)
    answers = engine.run(pending)
    try:
        with nullcontext() if engine.interruptible else interrupt.immediate():
            for i in itertools.count():
                if engine.interruptible and stop.requested():  # before the next sample: none is lost
                    raise interrupt.Interrupted(
                        f"stopped: {len(pending) - i} of {total} samples left to run in {where}"
                    )
                answered = next(answers, None)
                if answered is None:
                    break
                done, results = answered
                same_baseline(recorded.get((done.sample_id, BASELINE)), results[0], done.sample_id)
                scored = [r if r.score is not None else _scored(r, task, done) for r in results]
                rows = pair(head, done.row, scored, flips=not task.teacher_forced)
                writer.write(*(r for r in rows if (r.sample_id, r.variant) not in recorded))  # the sample's rows whole
                progress.update()
    finally:
        answers.close()
        writer.close()
        progress.close()


def _scored(result: Result, task: Task, job: Job) -> Result:
    """A generated answer scored by the task (an engine that scores, from logits or by lm-eval's metric, says its
    own score)."""
    return dataclasses.replace(result, score=task.score(result.prediction, job.sample))


def same_baseline(old: dict | None, new: Result, sample_id: str) -> None:
    """On resume: the baseline answers a sample as its recorded row says, or the engine changed under the rows."""
    if old is not None and old.get("prediction") != new.prediction:
        raise ConfigError(
            f"resume=true, but the baseline now answers sample {sample_id!r} with {new.prediction!r}, "
            f"not {old.get('prediction')!r} as recorded: the engine or server changed; run it in a new folder"
        )


def check_engine(run_info: RunInfo, opened: dict) -> None:
    """On resume: the same engine version and the same model weights as the rows already written."""
    for key, field in (("engine", "engine_version"), ("model", "fingerprint")):
        old = (getattr(run_info, key) or {}).get(field)
        if key in opened and old is not None and old != opened[key].get(field):
            new = opened[key].get(field)
            raise ConfigError(f"resume=true, but the {key}'s {field} changed ({old} -> {new}); run it in a new folder")


def finish(out_dir: Path, console: TextIO | None = None) -> dict[str, Any]:
    """summary.json from every row of the folder, printed as a table (to stdout, or `console`); the summary."""
    summary = summarize(read_rows(out_dir / SAMPLES))
    write_json(out_dir / SUMMARY, summary)
    print(format_summary(summary), file=console or sys.stdout)
    return summary
