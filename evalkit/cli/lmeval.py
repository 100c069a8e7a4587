"""lm-eval's own command line with the evalkit model (`python -m evalkit.lmeval --model evalkit ...`): lm-eval's
parser reads the command; `--model evalkit` runs through evalkit's sample loop (evalkit.run.loop: the folder's lock,
resume, Ctrl-C, run.json), its paired records written as documents finish, lm-eval's table and output beside; any
other model runs as lm-eval runs it. Under evalkit's exit codes."""

from __future__ import annotations

import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from lm_eval.__main__ import HarnessCLI
from lm_eval.api.registry import register_model
from lm_eval.config.evaluate_config import EvaluatorConfig
from lm_eval.loggers import EvaluationTracker
from lm_eval.utils import make_table
from omegaconf import OmegaConf

from evalkit.cli.config import variants as parse_variants
from evalkit.cli.spec import model_spec
from evalkit.config.choices import did_you_mean, options
from evalkit.engine import models
from evalkit.engine.hf import prepare_policies
from evalkit.errors import EXIT_INTERRUPTED, ConfigError
from evalkit.lmeval.evaluate import LmevalEngine, refuse_reconstruction
from evalkit.lmeval.model import EvalkitLM
from evalkit.lock import RunLock
from evalkit.modelspec import ModelSpec
from evalkit.records import SAMPLES, cut_torn
from evalkit.run import interrupt
from evalkit.run.loop import finish, run_samples
from evalkit.run.resume import start
from evalkit.tasks.lmeval import LmEvalTask
from evalkit.tasks.lmeval_index import task_dir

# What `--model_args` takes for the evalkit model: CommandLineLM's own arguments, then the command line's (where the
# records go, whether to continue them, how many documents lm-eval answers per call).
MODEL_ARGS = ("model", "variant", "device", "max_gen_toks", "rolling_split", "metric", "records")
RUN_ARGS = ("resume", "documents_per_call")
SEEDS = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")  # lm-eval's --seed, in order


def unknown_arg(key: str, valid: tuple[str, ...] = MODEL_ARGS) -> str:
    hint = did_you_mean(key, list(valid))
    return f"--model_args {key}=...: the evalkit model takes no {key!r}{hint}; its arguments: {', '.join(valid)}"


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
        prepare_policies([parsed], loaded)  # once, as evalkit's engine prepares its own (EvalkitLM takes them ready)
        super().__init__(loaded, parsed, max_gen_toks, rolling_split, metric, records)


def model_args(given: dict[str, Any]) -> dict[str, Any]:
    """The command line's `--model_args` for the evalkit model, defaults filled in; an unknown key is refused."""
    valid = MODEL_ARGS + RUN_ARGS
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ConfigError(unknown_arg(unknown[0], valid))
    out = {"model": "smollm2-135m", "variant": "none@1.0", "device": "cpu", "max_gen_toks": 64, "rolling_split": 0.5}
    out |= {"metric": None, "records": None, "resume": False, "documents_per_call": None, **given}
    if str(out["device"]).startswith("cuda") and not torch.cuda.is_available():
        print(f"evalkit: device={out['device']} but CUDA is not available; running on the CPU", file=sys.stderr)
        out["device"] = "cpu"
    if not isinstance(out["resume"], bool):
        raise ConfigError(f"--model_args resume={out['resume']!r}: give True or False")
    return out


def lm_eval_task(cfg: EvaluatorConfig, args: dict[str, Any]) -> LmEvalTask:
    """The lm-eval tasks the command names as evalkit's task=lm_eval (its --metadata less the evalkit model's own
    arguments, which lm-eval merges into it)."""
    metadata = {k: v for k, v in (cfg.metadata or {}).items() if k not in MODEL_ARGS + RUN_ARGS}
    include = cfg.include_path if isinstance(cfg.include_path, list) else [cfg.include_path]
    return LmEvalTask(
        tasks=[str(t) for t in cfg.tasks],
        limit=cfg.limit,
        num_fewshot=cfg.num_fewshot,
        metadata=metadata,
        gen_kwargs=dict(cfg.gen_kwargs or {}),
        metric=args["metric"],
        documents_per_call=None if args["documents_per_call"] is None else int(args["documents_per_call"]),
        include=[str(p) for p in include if p],
    )


def paired(cfg: EvaluatorConfig) -> dict:
    """`--model evalkit`: the variant and the baseline on lm-eval's tasks through evalkit's sample loop, into
    `records=DIR` (resume=True continues a run stopped there); lm-eval's table and output for the variant."""
    if cfg.use_cache:
        raise ConfigError("--use_cache: a cached answer has no baseline beside it; run the evalkit model without it")
    if cfg.samples:
        raise ConfigError("--samples: the evalkit model runs every document (or --limit); drop --samples")
    args = model_args(dict(cfg.model_args or {}))
    cfg.process_tasks(cfg.metadata)  # lm-eval's own refusal of a task it does not know
    task = lm_eval_task(cfg, args)
    (variant,) = parse_variants(OmegaConf.create({"seed": 0, "variants": [args["variant"]]}))
    refuse_reconstruction([variant])
    if task.documents_per_call is not None and cfg.output_path:
        raise ConfigError("--output_path: lm-eval's results need one call over every document; drop documents_per_call")
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    label = "".join(c if c.isalnum() or c in "@.+-_" else "_" for c in variant.name)
    out = Path(args["records"] or Path("results") / "lm_eval_cli" / args["model"] / label / started.replace(":", "-"))
    seeds = dict(zip(SEEDS, cfg.seed or [], strict=False))
    lm_args = {k: args[k] for k in ("max_gen_toks", "rolling_split")}
    engine = LmevalEngine(
        model_config(args["model"]), args["device"], task, [variant], out, lm_args=lm_args, seeds=seeds
    )
    config = {"model": {"name": args["model"]}, "task": task_config(task), "variants": [variant.name]}
    config |= {"model_args": {k: v for k, v in args.items() if k not in ("records", "resume")}}
    stop = interrupt.Stop()  # the command's: the first Ctrl-C stops after the documents in flight
    with RunLock(out), stop.deferred():
        run_info = start(out, {**config, "protocol": "query_agnostic", "seed": 0}, args["resume"], task)
        run_info.route = "lm_eval command line (python -m evalkit.lmeval)"
        cut_torn(out / SAMPLES)
        try:
            run_samples(engine, out, run_info, task, None, stop)
        except interrupt.Interrupted as err:
            print(f"evalkit: {err}; to resume: add resume=True to --model_args (records={out})", file=sys.stderr)
            raise SystemExit(EXIT_INTERRUPTED) from None
        finish(out, sys.stderr)
    print(f"evalkit: paired records (baseline and {variant.name}): {out}", file=sys.stderr)
    return engine.outputs.get(variant.name, {})


def task_config(task: LmEvalTask) -> dict[str, Any]:
    """What run.json records of the task: what decides the documents and how they are scored."""
    keys = ("name", "tasks", "limit", "num_fewshot", "metadata", "gen_kwargs", "metric", "documents_per_call")
    return {k: getattr(task, k) for k in keys}


def lm_eval_output(cfg: EvaluatorConfig, run: dict) -> None:
    """lm-eval's own output of the variant's run: its table, and its results (and samples, --log_samples) under
    --output_path."""
    if not run:
        return
    samples = run.pop("samples", {})
    print(make_table(run))
    if cfg.output_path:
        tracker = EvaluationTracker(**{**cfg.hf_hub_log_args, "output_path": cfg.output_path})
        tracker.general_config_tracker.log_experiment_args("evalkit", dict(cfg.model_args or {}), None, None, False)
        tracker.save_results_aggregated(results=run, samples=samples if cfg.log_samples else None)
        for name in run.get("configs", {}) if cfg.log_samples else ():
            tracker.save_results_samples(task_name=name, samples=samples[name])


def main() -> int:
    """lm-eval's own command line, with evalkit's model registered and its offline tasks on the include path,
    under evalkit's exit codes (lm-eval reports bad arguments, such as an unknown task, as ValueError: exit 2).
    `--model evalkit` runs through evalkit's sample loop (paired); any other model as lm-eval runs it."""
    if "--include_path" not in sys.argv:
        sys.argv += ["--include_path", str(task_dir())]
    parser = HarnessCLI()
    try:
        args = parser.parse_args()
        if getattr(args, "command", None) == "run" and args.model == "evalkit":
            cfg = EvaluatorConfig.from_cli(args)
            lm_eval_output(cfg, paired(cfg))
        else:
            parser.execute(args)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"lm-eval: {str(err).splitlines()[0]}") from None
    return 0
