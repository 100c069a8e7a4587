"""lm-eval's own command line with the evalkit model (`python -m evalkit.lmeval --model evalkit ...`): the paired
records written beside lm-eval's output, under evalkit's exit codes."""

from __future__ import annotations

import functools
import sys
import time
import uuid
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string
from omegaconf import OmegaConf

from evalkit.cli.config import variants as parse_variants
from evalkit.cli.spec import model_spec
from evalkit.config.choices import did_you_mean, options
from evalkit.engine import models
from evalkit.errors import ConfigError
from evalkit.lmeval.evaluate import documents, load_tasks, model_tokenizer, refuse_reconstruction
from evalkit.lmeval.metrics import choose_metrics
from evalkit.lmeval.model import EvalkitLM
from evalkit.modelspec import ModelSpec
from evalkit.records import BASELINE, RUN, SAMPLES, Job, RecordWriter, Result, RunInfo, pair, write_json
from evalkit.run.loop import finish
from evalkit.run.resume import versions
from evalkit.tasks.lmeval_index import task_dir, task_manager

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

# What `--model_args` takes for the evalkit model (CommandLineLM's own arguments).
MODEL_ARGS = ("model", "variant", "device", "max_gen_toks", "rolling_split", "metric", "records")


def unknown_arg(key: str) -> str:
    hint = did_you_mean(key, list(MODEL_ARGS))
    return f"--model_args {key}=...: the evalkit model takes no {key!r}{hint}; its arguments: {', '.join(MODEL_ARGS)}"


def model_config(name: str) -> ModelSpec:
    """conf/model/NAME.yaml, or a ConfigError listing the model names there."""
    valid = options("model", ())
    if name not in valid:
        raise ConfigError(
            f"--model_args model={name!r}: unknown model{did_you_mean(name, valid)}; valid names: {', '.join(valid)}"
        )
    return model_spec(OmegaConf.load(files("evalkit.conf") / "model" / f"{name}.yaml"))


@register_model("evalkit")
class CommandLineLM(EvalkitLM):
    """`--model evalkit --model_args model=NAME,variant=SPEC,...`: the evalkit model built from lm-eval's strings (a
    conf/model name, a variant as in `variants=[...]`); an argument it does not take is refused, not swallowed."""

    def __init__(
        self,
        model: str = "smollm2-135m",
        variant: str = "none@1.0",
        device: str = "cpu",
        max_gen_toks: int = 64,
        rolling_split: float = 0.5,
        metric: str | None = None,
        records: str | None = None,
        batch_size: Any = None,  # lm-eval passes these to every model; evalkit decodes one request at a time
        max_batch_size: Any = None,
        **unknown: Any,
    ):
        if unknown:
            raise ConfigError(unknown_arg(sorted(unknown)[0]))
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            print(f"evalkit: device={device} but CUDA is not available; running on the CPU", file=sys.stderr)
            device = "cpu"
        (parsed,) = parse_variants(OmegaConf.create({"seed": 0, "variants": [variant]}))
        loaded = models.load(model_config(model), device)
        super().__init__(loaded, parsed, max_gen_toks, rolling_split, metric, records)


def write_records(out_dir: Path, answered: list[tuple[Job, list[Result]]], run_info: RunInfo, task_name: str) -> dict:
    """samples.jsonl (each document's rows paired with the baseline's, as the Hydra route writes them), run.json
    and summary.json in out_dir; the summary."""

    if (out_dir / SAMPLES).exists():
        raise ConfigError(f"{out_dir} already holds results; choose another folder with --model_args records=DIR")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / RUN, run_info.to_dict())
    writer = RecordWriter(out_dir / SAMPLES)
    try:
        for job, results in answered:
            writer.write(*pair(run_info.head(task_name), job.row, results))
    finally:
        writer.close()
    summary = finish(out_dir, sys.stderr)
    variant = answered[0][1][-1].variant if answered else "variant"
    print(f"evalkit: paired records (baseline and {variant}): {out_dir}", file=sys.stderr)
    return summary


def _paired_evaluate(real, *, model=None, model_args=None, **kwargs):
    """lm-eval's simple_evaluate for its command line: `--model evalkit` runs the variant, replays its baseline
    through lm-eval on the same task objects, and writes evalkit's paired records (write_records) beside lm-eval's
    own output; the variant's results go back to lm-eval's command line. Any other model runs as lm-eval runs it."""
    if model != "evalkit":
        return real(model=model, model_args=model_args, **kwargs)
    if kwargs.get("use_cache"):
        raise ConfigError("--use_cache: a cached answer has no baseline beside it; run the evalkit model without it")
    args = simple_parse_args_string(model_args) if isinstance(model_args, str) else dict(model_args or {})
    extra = {k: kwargs.get(k) for k in ("batch_size", "max_batch_size", "device")}
    lm = CommandLineLM.create_from_arg_obj(args, extra)
    refuse_reconstruction([lm.variant])
    names = kwargs.pop("tasks")
    manager = _manager(kwargs.pop("task_manager", None), names, {**args, **(kwargs.get("metadata") or {})}, lm)
    objects = load_tasks(
        manager, list(names), {k: kwargs.get(k) for k in ("random_seed", "numpy_random_seed", "torch_random_seed")}
    )
    plan = choose_metrics(manager.load(objects)["tasks"], lm.metric, "--model_args metric")
    asked_samples = bool(kwargs.pop("log_samples", False))
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    run = real(model=lm, tasks=objects, task_manager=manager, log_samples=True, **kwargs)
    quiet = {**kwargs, "evaluation_tracker": None}
    baseline = real(model=lm.baseline(), tasks=objects, task_manager=manager, log_samples=True, **quiet)
    answered = documents([(lm, run)], baseline, plan)
    label = "".join(c if c.isalnum() or c in "@.+-_" else "_" for c in lm.variant.name)
    out = Path(lm.records or Path("results") / "lm_eval_cli" / lm.loaded.name / label / started.replace(":", "-"))
    write_records(out, answered, _run_info(lm, list(names), args, kwargs, started), "lm_eval")
    write_json(out / "lm_eval_results.json", {BASELINE: baseline["results"], lm.variant.name: run["results"]})
    if not asked_samples:
        run.pop("samples", None)
    run.setdefault("config", {})["model"] = "evalkit"
    return run


def _manager(manager: TaskManager | None, names: list, metadata: dict, lm: CommandLineLM) -> TaskManager:
    """lm-eval's task manager (lm-eval's own, when it has one with a tokenizer), with the model's own tokenizer
    where the command line names none (RULER would read `model=`, evalkit's config name, as a tokenizer to size
    its haystacks)."""
    if not (metadata.get("tokenizer") or metadata.get("pretrained")):
        metadata["tokenizer"] = model_tokenizer(lm.loaded)
    elif manager is not None:
        return manager
    include = manager.include_path if manager is not None else None
    paths = [str(p) for p in (include if isinstance(include, (list, tuple)) else [include])] if include else None
    return task_manager(names if all(isinstance(n, str) for n in names) else None, metadata, paths)


def _run_info(lm: CommandLineLM, names: list[str], args: dict, kwargs: dict, started: str) -> RunInfo:
    """run.json of a command-line run: what the gate needs (config, model fingerprint, versions) and the command."""
    task = {"name": "lm_eval", "tasks": names, "metric": lm.metric}
    task |= {k: kwargs.get(k) for k in ("limit", "num_fewshot", "metadata")}
    config = {"model": {"name": lm.loaded.name}, "task": task, "variants": [lm.variant.name], "model_args": args}
    return RunInfo(
        run_id=uuid.uuid4().hex[:12],
        route="lm_eval command line (python -m evalkit.lmeval)",
        config={**config, "protocol": "query_agnostic", "seed": 0},
        versions=versions(),
        command=sys.argv,
        started=started,
        protocol="query_agnostic",
        seed=0,
        model=lm.loaded.info(),
    )


def main() -> int:
    """lm-eval's own command line, with evalkit's model registered and its offline tasks on the include path,
    under evalkit's exit codes (lm-eval reports bad arguments, such as an unknown task, as ValueError: exit 2).
    With `--model evalkit`, the paired records are written too (_paired_evaluate)."""
    import lm_eval
    from lm_eval.__main__ import cli_evaluate

    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(task_dir())]
    real = lm_eval.simple_evaluate
    lm_eval.simple_evaluate = functools.partial(_paired_evaluate, real)
    try:
        cli_evaluate()
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"lm-eval: {str(err).splitlines()[0]}") from None
    finally:
        lm_eval.simple_evaluate = real
    return 0
