"""Every config in conf/ composes and instantiates; a broken YAML fails here."""

from __future__ import annotations

import re

import pytest
import torch
from hydra.utils import instantiate

from evalkit.cli.config import build, wrapped_fields
from evalkit.cli.precheck import precheck
from evalkit.cli.spec import check, model_spec
from evalkit.config.choices import check_choices, options
from evalkit.engine import models
from evalkit.errors import ConfigError
from evalkit.fields import describe, fits
from evalkit.policies import KVPolicy
from evalkit.policies.h2o import H2O
from evalkit.policies.knorm import KNorm
from evalkit.policies.pyramidkv import PyramidKV
from evalkit.policies.random import RandomKeep
from evalkit.policies.snapkv import SnapKV
from evalkit.policies.streaming_llm import StreamingLLM
from evalkit.tasks import Task
from evalkit.tasks.fidelity import FidelityTask
from evalkit.tasks.lmeval import LmEvalTask
from evalkit.tasks.middoc import MiddocTask
from evalkit.tasks.needle import NeedleTask
from tests.conftest import WEIGHTS_TINY, compose_config


@pytest.mark.parametrize("name", options("policy"))
def test_every_policy_config_composes_and_instantiates(name):
    question = ["protocol=query_aware"] if name == "finch" else []  # it scores by the question in the context
    cfg = compose_config(f"policy={name}", "model=tiny-random", *question)
    policy = build(cfg.policy, "policy")
    # one name: file, class `name`, records; a wrapper records the policy it wraps, chunkkv(snapkv)
    assert isinstance(policy, KVPolicy) and policy.name.split("(")[0] == name
    if wrapped_fields(type(policy)):  # a wrapper holds a policy object, which the command line builds from its name
        inner = cfg.policy.inner if isinstance(cfg.policy.inner, str) else cfg.policy.inner.name  # or its mapping
        assert isinstance(policy.inner, KVPolicy) and policy.inner.name == inner
    else:  # evalkit's build gives what Hydra's instantiate gives
        assert instantiate(cfg.policy, _convert_="all") == policy
    if name in WEIGHTS_TINY:  # its learned weights are the one required setting
        with pytest.raises(ConfigError, match=f"{name} needs its .*: give weights_path="):
            policy.validate(None)
        cfg.policy.weights_path = str(WEIGHTS_TINY[name])
        policy = build(cfg.policy, "policy")
    if name == "dms":  # its threshold and its inner kvzap's surrogates are required settings
        with pytest.raises(ConfigError, match="dms needs threshold, in its inner policy's score units"):
            policy.validate(None)
        cfg.policy.threshold, cfg.policy.inner.weights_path = -9.0, str(WEIGHTS_TINY["kvzap"])
        policy = build(cfg.policy, "policy")
    policy.validate(None)  # every value of the shipped YAML has its field's type
    check(cfg)  # and the whole config passes the checks made before a model loads


@pytest.mark.parametrize("name", options("task"))
def test_every_task_config_composes_and_validates(name, monkeypatch):
    task = instantiate(compose_config(f"task={name}").task, _convert_="all")
    assert isinstance(task, Task) and task.name == name
    if name == "jsonl":  # the user's file is the one required setting
        with pytest.raises(ConfigError, match="needs task.path=FILE"):
            task.validate()
        return
    if name == "hf":  # the dataset is the one required setting
        with pytest.raises(ConfigError, match="task=hf needs task.path"):
            task.validate()
        return
    if getattr(task, "scorer", None):  # a Hub dataset's preset (task=ruler, ...): offline here, no copy cached
        import datasets
        import huggingface_hub

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        with pytest.raises(ConfigError, match=f"dataset {task.path!r}.*save_to_disk"):
            task.validate()
        return
    task.validate()


@pytest.mark.parametrize("name", options("model"))
def test_every_model_config_composes(name):
    cfg = compose_config(f"model={name}").model
    assert cfg.name == name
    if name != "hf":  # hf needs model.name_or_path from the user
        assert models.max_context(model_spec(cfg)) > 0


def test_groups_have_the_documented_options():
    assert {"none", "streaming_llm"} <= set(options("policy"))
    assert {"smollm2-135m", "gemma3-270m", "hf", "tiny-random"} <= set(options("model"))
    assert "needle" in options("task")


def test_unknown_names_list_the_valid_ones_and_suggest_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown policy 'streaming'.*did you mean streaming_llm.*none"):
        check_choices(["policy=streaming"])
    with pytest.raises(ConfigError, match=r"unknown model 'nope'"):
        check_choices(["task=needle", "model=tiny-random,nope"])
    check_choices(["policy=none", "task.depths=[0.5]", "model=tiny-random"])


@pytest.mark.parametrize("name", options("quant"))
def test_every_quant_config_composes_into_a_storage_spec(name):
    from evalkit.cli.config import quant_spec

    spec = quant_spec(compose_config(f"quant={name}").quant)
    assert (spec is None) == (name == "none") and (spec is None or spec.name == name)


@pytest.mark.parametrize("name", options("gate"))
def test_every_gate_config_composes_into_thresholds(name):
    from evalkit.cli.gate import load_thresholds

    assert load_thresholds(name) is not None
    assert compose_config(f"gate={name}").gate.name == name


def test_the_thresholds_defaults_are_conf_gate_default_yaml():
    """The report falls back to Thresholds() where no verdict names its thresholds: they must be default.yaml's."""
    from evalkit.cli.gate import load_thresholds
    from evalkit.thresholds import Thresholds

    assert load_thresholds("default") == Thresholds()
    assert load_thresholds("default") != Thresholds(max_drop=0.04)  # control: a changed value is seen


@pytest.mark.parametrize("name", options("logger"))
def test_every_logger_config_composes(name):
    assert compose_config(f"logger={name}").logger.name == name


# --- checks before any model loads ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sed=1"], "unknown key sed (did you mean seed?); valid keys: backend, device, gate, logger, model, policy,"),
        (["polcy.budget=0.5"], "unknown key polcy (did you mean policy?)"),
        (
            ["policy=h2o", "policy.n_sink=2"],
            "unknown key policy.n_sink; valid keys: budget, decode, decode_interval, name, normalize, recent",
        ),
        (["++policy.windw=8", "policy=snapkv"], "unknown key policy.windw (did you mean policy.window?)"),
        (["task.digits=5"], "task.digits is not in the task config file, but task takes it: add it with a '+', "),
        (["+policy.budget=0.3"], "policy.budget is in the config already: override it without the '+', "),
        (["~policy.foo"], "~policy.foo: policy.foo is not in the config, so there is nothing to delete"),
        (["policy.budget.x=1"], "policy.budget is a single value, it has no key 'x'"),
        (["policy.budget=0.25,0.5"], "holds a comma: to sweep over the values add -m; for a list write "),
        (["policy.budget=choice(0.25,0.5)"], "requires --multirun: add -m to run the sweep"),
        (["hydra.job.chdir=abc"], "hydra.job.chdir=abc: Value 'abc' is not a valid bool"),
        (["model=hf"], "model.name_or_path must be given (its config leaves it '???')"),
        (["seed=${nowhere}"], "Interpolation key 'nowhere' not found"),
        (["model.max_context=abc"], "model.max_context='abc' is not a positive whole number of tokens"),
        (["quant=int4", "quant.group=abc"], "quant.group='abc' is not a whole number"),
        (["reserve_tokens=-1"], "reserve_tokens=-1 is negative"),
        (["resume=yes"], "resume='yes' is not true or false"),
        (["device=cuda:x"], "device='cuda:x' is not one of auto, cpu, cuda"),
        (["task=lm_eval", "task.limit=0"], "task.limit=0: give a number of documents >= 1"),
        (["+task.keys=1000"], "task.keys=1000: at most 440 distinct keys exist"),
        (["-m", "policy=h2o,snapkv", "policy.window=8"], "[model=tiny-random policy=h2o policy.window=8] unknown key"),
        (["-m", "policy.budget=0.25,2.0"], "[model=tiny-random policy.budget=2.0] policy.budget=2.0 is outside (0, 1]"),
        # a wrapper's policy (ChunkKV's inner), and wrappers in variants
        (
            ["policy=chunkkv", "policy.inner.window=8"],
            "policy.inner=snapkv names a policy; to set its fields too, write 'policy.inner={name:snapkv,window:8}'",
        ),
        (["policy=chunkkv", "policy.inner=snapk"], "policy.inner: unknown policy 'snapk' (did you mean snapkv?)"),
        (["policy=chunkkv", "policy.inner=[1]"], "policy.inner=[1]: give a policy's name, e.g. policy.inner=snapkv"),
        (
            ["policy=chunkkv", "policy.inner={name:snapkv,windw:8}"],
            "unknown key policy.inner.windw (did you mean policy.inner.window?)",
        ),
        (["policy=chunkkv", "policy.inner={name:snapkv,window:0}"], "policy.inner.window=0: the observation window"),
        (["policy=chunkkv", "policy.inner=pyramidkv", "policy.decode=true"], "chunkkv(pyramidkv) compresses once"),
        (["policy=chunkkv", "policy.chunk_size=0"], "policy.chunk_size=0: a chunk holds at least 1 token"),
        (
            ["variants=[chunkkv(snapkv)@0.25,h2o@0.25]"],
            "Hydra reads chunkkv(snapkv) as a function call: quote the variants that wrap a policy, "
            "'variants=[\"chunkkv(snapkv)@0.25\",h2o@0.25]', or write them as chunkkv/snapkv@0.25",
        ),
        (['variants=["snapkv(h2o)@0.25"]'], "variants: snapkv in 'snapkv(h2o)@0.25' wraps no policy"),
        (['variants=["chunkkv(h2oo)@0.25"]'], "variants: unknown policy 'h2oo' in 'chunkkv(h2oo)@0.25' (did you mean"),
        (["variants=[chunkkv/pyramidkv@0.25:chunk64]"], "chunkkv(pyramidkv) does not support a chunked prefill"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_precheck_names_the_problem_and_its_fix_on_one_line(argv, message):
    with pytest.raises(ConfigError) as err:
        precheck(["model=tiny-random", *argv])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_precheck_passes_good_commands_and_leaves_other_modes_to_hydra():
    precheck(["model=tiny-random", "policy=snapkv", "task.depths=[0.5]", "+task.digits=5"])
    precheck(["-m", "model=tiny-random", "policy=h2o,snapkv", "policy.budget=0.25,512", "hydra/launcher=joblib"])
    precheck(["-m", "model=tiny-random", "policy=glob(*kv)"])  # a glob needs the config to list: left to the jobs
    precheck(["model=tiny-random", "policy=chunkkv", "policy.inner={name:snapkv,window:8}", "policy.chunk_size=4"])
    precheck(["model=tiny-random", 'variants=["chunkkv(snapkv)@0.25",chunkkv/h2o@0.5,"chunkkv(chunkkv(knorm))@64"]'])
    precheck(["--cfg", "job", "policy.budgt=1"])  # Hydra prints the config; nothing runs
    precheck(["--help"])


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (H2O(budget=0.25, recent=2.0), "recent=2.0 is outside [0, 1]"),
        (H2O(budget=0.25, decode=1), "decode=1 is not true or false; give e.g. decode=true"),
        (StreamingLLM(budget=0.25, n_sink=-1), "n_sink=-1 is negative"),
        (StreamingLLM(budget=0.25, n_sink=4.0), "n_sink=4.0 is not a whole number; give e.g. n_sink=4"),
        (SnapKV(budget=0.25, window=0), "window=0: the observation window needs at least 1 query"),
        (SnapKV(budget=0.25, kernel=True), "kernel=true is not a whole number"),
        (SnapKV(budget=0.25, pooling="median"), "pooling='median' is not one of ['avg', 'max']"),
        (PyramidKV(budget=0.25, decode=False, beta="steep"), "beta='steep' is not a number"),
        (PyramidKV(budget=0.25, decode=False, beta=0.5), "beta=0.5 must be >= 1"),
        (RandomKeep(budget=0.25, seed=1.5), "seed=1.5 is not a whole number"),
        (KNorm(budget=0), "budget=0 keeps no token"),
        (KNorm(budget="half"), "budget='half': give a fraction in (0, 1] or a whole number of tokens"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_policy_validate_checks_types_and_ranges(policy, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        policy.validate(None)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        (NeedleTask(samples_per_cell=1.5), "task.samples_per_cell=1.5 is not a whole number"),
        (NeedleTask(depths=["abc"]), "task.depths=['abc'] is not a list of numbers; give e.g. 'task.depths=[0.0,"),
        (NeedleTask(context_lengths=[1024.0]), "task.context_lengths=[1024.0] is not a list of whole numbers"),
        (NeedleTask(seed="abc"), "task.seed='abc' is not a whole number"),
        (NeedleTask(digits=0), "task.digits=0: give a number of digits from 1 to 30"),
        (NeedleTask(max_new_tokens=0), "task.max_new_tokens=0: the answer needs at least 1 token(s)"),
        (MiddocTask(positions=[True]), "task.positions=[true] is not a list of numbers"),
        (FidelityTask(continuation_tokens=2.5), "task.continuation_tokens=2.5 is not a whole number"),
        (FidelityTask(context_lengths=[8]), "task.context_lengths=[8]: use at least 16 tokens"),
        (LmEvalTask(tasks="evalkit_recall"), "task.tasks='evalkit_recall' is not a list of strings"),
        (LmEvalTask(limit=0), "task.limit=0: give a number of documents >= 1"),
        (LmEvalTask(num_fewshot=-1), "task.num_fewshot=-1 is negative"),
        (LmEvalTask(limit=2.5), "task.limit=2.5 is not a whole number or null"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_task_validate_checks_types_and_ranges(task, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        task.validate()


def test_field_types_are_strict_where_yaml_is_loose():
    assert fits(3, int) and not fits(True, int) and not fits(1.5, int) and not fits("3", int)
    assert fits(2, float) and fits(0.5, float) and not fits(False, float)
    assert fits(True, bool) and not fits(1, bool) and not fits("true", bool)
    assert fits(None, int | None) and fits([1, 2], list[int]) and not fits([1, "a"], list[int])
    assert describe(list[float]) == "a list of numbers" and describe(int | None) == "a whole number or null"
    assert describe(float | int) == "a number"


def test_devices_are_checked_before_anything_loads():
    models.check_device("auto")
    models.check_device("cpu")
    for bad in ("tpu", "cuda:x", "cpu:0", "gpu"):
        with pytest.raises(ConfigError, match="is not one of auto, cpu, cuda"):
            models.check_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU is visible here; use device=cpu or auto"):
            models.pick_device("cuda")
