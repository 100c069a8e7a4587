"""The run loop of a backend: jobs out, scored and paired rows in, as evalkit's own engine writes them.

evalkit.run builds the samples and prompts (and checks them) for every backend, then calls `run_backend` where
`backend=hf` would load its model. Rows are written as each sample finishes; resume skips what is written, runs the
baseline again for each sample a variant still needs, and refuses a baseline that now answers otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from evalkit.backends import Backend, BackendSpec, Job, Result
from evalkit.errors import ConfigError
from evalkit.gate.evidence import flip
from evalkit.records import RUN, RecordWriter, read_rows, write_json
from evalkit.run import interrupt

BASELINE = "baseline"
# evalkit's protocols say which tokens its engine compresses (the context, or the whole prompt); an engine's cache
# type holds every token, prompt and answer alike
PROTOCOL = "engine: every token in the engine's cache type"


def run_backend(
    engine: Backend,
    spec: BackendSpec,
    run_info: dict[str, Any],
    task: Any,
    samples: list,
    prompts: list,
    texts: dict[str, str],
    rows_path: Path,
) -> None:
    """Let `engine` answer each sample (the baseline, and the variants whose rows are missing) and write the rows;
    `prompts` are evalkit.tasks.prompt.Prompt objects, `texts` the same prompts rendered as text, by sample id."""
    names = [BASELINE, *engine.variant_names()]
    recorded = {(r["sample_id"], r["variant"]): r for r in read_rows(rows_path, repair=True)}
    jobs = [
        Job(s.id, p.ids[0].tolist(), texts[s.id], task.answer_tokens(s), todo)
        for s, p in zip(samples, prompts, strict=True)
        if (todo := [n for n in names[1:] if (s.id, n) not in recorded]) or (s.id, BASELINE) not in recorded
    ]
    if recorded:
        print(f"evalkit: resuming {rows_path.parent}: {len(samples) - len(jobs)} of {len(samples)} samples done before")
    opened = engine.open(spec, jobs)
    check_engine(run_info, opened)
    run_info.update(opened)
    write_json(rows_path.parent / RUN, run_info)
    by_id = {s.id: (s, p) for s, p in zip(samples, prompts, strict=True)}
    writer = RecordWriter(rows_path)
    try:
        done = tqdm(engine.run(jobs), total=len(jobs), desc=f"{task.name} x {', '.join(names[1:])}", file=sys.stderr)
        for i, (job, results) in enumerate(done):
            if interrupt.requested():
                raise interrupt.Interrupted(f"stopped: {len(jobs) - i} of {len(samples)} samples left to run")
            sample, prompt = by_id[job.sample_id]
            old = recorded.get((sample.id, BASELINE))
            if old is not None and old["prediction"] != results[0].prediction:
                raise ConfigError(
                    f"resume=true, but the baseline now answers sample {sample.id!r} with {results[0].prediction!r}, "
                    f"not {old['prediction']!r} as recorded: the engine or server changed; run it in a new folder"
                )
            missing = [
                r for r in rows(run_info, task, sample, prompt, results) if (sample.id, r["variant"]) not in recorded
            ]
            writer.write(*missing)  # the sample's rows whole
    finally:
        writer.close()
        engine.close()


def rows(run_info: dict, task: Any, sample: Any, prompt: Any, results: list[Result]) -> list[dict]:
    """The rows of one sample from a backend's results (the baseline's first): the fields every row has, the
    engine's own, and the pairing with the baseline."""
    base = results[0]
    base_score = task.score(base.prediction, sample)
    out = []
    for res in results:
        score = task.score(res.prediction, sample)
        out.append(
            {
                "run_id": run_info["run_id"],
                "sample_id": sample.id,
                "task": task.name,
                "cell": sample.cell,
                "variant": res.variant,
                "protocol": PROTOCOL,
                "question": sample.question,
                "prediction": res.prediction,
                "answers": sample.answers,
                "scorer": task.scorer_spec(sample),
                **res.fields,
                "kv_bytes_baseline": base.fields["kv_bytes"],
                "kv_bytes_baseline_deployed": base.fields["kv_bytes_deployed"],
                "budget_clipped": None if res is base else False,
                "context_tokens": prompt.n_context,
                "context_id": prompt.context_id,  # each engine prefills this context once per sample and variant
                "document_id": prompt.document_id,
                "prompt_tokens": int(prompt.ids.shape[1]),
                **task.row_fields(sample),
                "score": score,
                "baseline_score": base_score,
                "flip": flip(score, base_score),
            }
        )
    return out


def check_engine(run_info: dict, opened: dict) -> None:
    """On resume: the same engine version and the same model weights as the rows already written."""
    for key, field in (("engine", "engine_version"), ("model", "fingerprint")):
        old, new = (run_info.get(key) or {}).get(field), opened[key].get(field)
        if old is not None and old != new:
            raise ConfigError(f"resume=true, but the {key}'s {field} changed ({old} -> {new}); run it in a new folder")
