"""Every config in conf/ composes and instantiates; a broken YAML fails here."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate

from evalkit import models
from evalkit.config import check_choices, options
from evalkit.errors import ConfigError
from evalkit.policies import KVPolicy
from evalkit.tasks import Task
from tests.conftest import compose_config


@pytest.mark.parametrize("name", options("policy"))
def test_every_policy_config_composes_and_instantiates(name):
    policy = instantiate(compose_config(f"policy={name}").policy, _convert_="all")
    assert isinstance(policy, KVPolicy) and policy.name == name  # one name: file, class `name`, records


@pytest.mark.parametrize("name", options("task"))
def test_every_task_config_composes_and_validates(name):
    task = instantiate(compose_config(f"task={name}").task, _convert_="all")
    assert isinstance(task, Task) and task.name == name
    if name == "jsonl":  # the user's file is the one required setting
        with pytest.raises(ConfigError, match="needs task.path=FILE"):
            task.validate()
        return
    task.validate()


@pytest.mark.parametrize("name", options("model"))
def test_every_model_config_composes(name):
    cfg = compose_config(f"model={name}").model
    assert cfg.name == name
    if name != "hf":  # hf needs model.name_or_path from the user
        assert models.max_context(cfg) > 0


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
    from evalkit.config import quant_spec

    spec = quant_spec(compose_config(f"quant={name}").quant)
    assert (spec is None) == (name == "none") and (spec is None or spec.name == name)


@pytest.mark.parametrize("name", options("gate"))
def test_every_gate_config_composes_into_thresholds(name):
    from evalkit.gate import load_thresholds

    assert load_thresholds(name) is not None
    assert compose_config(f"gate={name}").gate.name == name


@pytest.mark.parametrize("name", options("logger"))
def test_every_logger_config_composes(name):
    assert compose_config(f"logger={name}").logger.name == name
