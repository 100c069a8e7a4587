"""A run folder's identity: run.json created, or a resumed run proved the same experiment (config, versions, input
files, samples, weights), and the rows already written re-derived before any is carried into the extended run."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import platform
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import torch
import transformers

import evalkit
from evalkit import scoring
from evalkit.embedded import file_sha256
from evalkit.errors import ConfigError
from evalkit.records import (
    RUN,
    SAMPLES,
    Row,
    RunInfo,
    config_differences,
    experiment_config,
    read_back,
    write_json,
)
from evalkit.records.checks import contradictions
from evalkit.tasks import Sample, Task
from evalkit.tasks.prompt import Prompt


def check_written(path: Path, task: Task, samples: list[Sample], prompts: list[Prompt]) -> None:
    """Before a run is resumed or extended, the rows already written must be what this run would have written:
    each a row the gate can read (evalkit.records.checks.row_problem), consistent with its baseline row
    (checks.contradictions), its score re-derived from its prediction by the task's scorer (teacher-forced rows,
    scored from logits, excepted), its context_id and document_id the sample's prompt's. An edited row is refused,
    naming file:line, rather than carried into the extended run."""
    if not path.exists():
        return
    rows, problems, _, lines = read_back(path)
    problems += contradictions(rows, lines, str(path))
    by_id = {s.id: (s, p) for s, p in zip(samples, prompts, strict=True)}
    for row, n in zip(rows, lines, strict=True):
        sample, prompt = by_id.get(row.sample_id, (None, None))
        why = _rederived(row, task, sample, prompt) if sample is not None else None
        if why:
            problems.append(f"{path}:{n}: {why}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(
            f"resume=true, but a row already written is not what this run writes: {problems[0]}{more}; the records "
            "were edited: restore them, or run afresh in a new folder"
        )


def _rederived(row: Row, task: Task, sample: Sample, prompt: Prompt) -> str | None:
    if row.get("context_id") != prompt.context_id:
        return f"context_id={row.get('context_id')!r}, but the sample's prompt compresses context {prompt.context_id!r}"
    if row.get("document_id") is not None and row["document_id"] != prompt.document_id:
        return f"document_id={row['document_id']!r}, but the sample's document is {prompt.document_id!r}"
    if task.teacher_forced:
        return None
    prediction = row.get("prediction")
    if not isinstance(prediction, str):
        return f"prediction={prediction!r}, not the text its score was given for"
    score = task.score(prediction, sample)
    if not math.isclose(score, row.score, abs_tol=scoring.TOLERANCE):
        return f"score={row['score']!r}, but its prediction {prediction[:60]!r} scores {score!r}"
    return None


_identity = experiment_config  # what must not change for resume=true to continue a run (evalkit.records)


def start(out_dir: Path, config: dict, resume: bool, task: Task) -> RunInfo:
    """Create run.json, or prove that the run being resumed is the same experiment: same config, library versions
    and input files (sha256); the samples and the engine are compared once they are known (check_samples_unchanged,
    evalkit.run.loop.check_engine)."""
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
        old = RunInfo.read(run_path)
        diffs = config_differences(_identity(old.config), _identity(comparable))
        diffs += [
            f"versions.{k}: {old.versions.get(k)!r} -> {now[k]!r}"
            for k in ("torch", "transformers")
            if old.versions.get(k) != now[k]
        ]
        old_files = (old.data or {}).get("files", {})
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
        old.resumed = [*(old.resumed or []), time.strftime("%Y-%m-%dT%H:%M:%S")]
        old.config = comparable  # the sample count may have grown
        return old
    info = RunInfo(
        run_id=uuid.uuid4().hex[:12],
        config=comparable,
        versions=now,
        data={"files": files},
        command=sys.argv,
        started=time.strftime("%Y-%m-%dT%H:%M:%S"),
        protocol=config["protocol"],
        seed=config["seed"],
        torch_threads=torch.get_num_threads(),
    )
    write_json(run_path, info.to_dict())
    return info


def _input_files(task: Task) -> list[str]:
    """The files a task reads its samples from (JSONL data), whose bytes are part of the run's identity."""
    if hasattr(task, "input_files"):  # task=hf: a file, a folder's data files, or none for a Hub id
        return task.input_files()
    path = getattr(task, "path", "")
    return [str(Path(path).resolve())] if path else []


def sample_digest(sample: Sample) -> str:
    """sha256 of everything a sample feeds the model and is scored against."""
    fields = dataclasses.asdict(sample)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_samples_unchanged(run_info: RunInfo, samples: list[Sample], out_dir: Path) -> None:
    """Record each sample's digest; on resume, refuse when the task now generates other samples than the rows
    already written answer. New samples beside unchanged old ones (a larger task.samples_per_cell) extend the run."""
    now = {s.id: sample_digest(s) for s in samples}
    data = run_info.data = run_info.data or {}
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


def versions() -> dict[str, str]:
    """Versions the results depend on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hydra": metadata.version("hydra-core"),  # the version alone: the run reads no Hydra config
        "evalkit": evalkit.__version__,
        "evalkit_git": git_sha(),
    }


def git_sha() -> str:
    """The evalkit checkout's commit (with '+dirty' for uncommitted changes), or 'unknown' when installed."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
