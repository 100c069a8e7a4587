"""`python -m evalkit.calibrate`: the learned methods' calibration and training tools shipped in the package. Its help
lists the six tools, one line each, before torch loads; each tool's help works; bad input is one line and exit 2;
and each tool, run on the tiny model with the options tests/conftest.py's WEIGHTS_TINY names, writes again the
weights in tests/data that the benchmarks/ scripts it replaces wrote."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from evalkit.calibrate.main import main
from tests.conftest import COMMAND_ENV, ROOT, WEIGHTS_TINY

# the tools the issue names, and the policy each line must name
TOOLS = {
    "qfilter": "policy=qfilter",
    "kvzap": "policy=kvzap",
    "fastkvzip": "policy=fastkvzip",
    "lukv": "policy=lukv",
    "ea_stats": "policy=expected_attention_stats",
    "restorekv": "policy=restorekv",
}
TINY = ["--model", "tiny-random", "--lengths", "128", "--depths", "0.5"]


def test_help_lists_every_tool_on_one_line_before_torch_loads():
    code = (
        "import sys\nfrom evalkit.calibrate.main import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    print('exit', e.code)\n"
        "print('torch loaded' if 'torch' in sys.modules else 'no torch')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    assert lines[-2:] == ["exit 0", "no torch"], done.stdout + done.stderr
    for tool, policy in TOOLS.items():
        (line,) = [x for x in lines if x.split()[:1] == [tool]]
        assert policy in line, line


def test_the_module_runs_as_a_command():
    done = subprocess.run(
        [sys.executable, "-m", "evalkit.calibrate", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**COMMAND_ENV, "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0 and "usage: python -m evalkit.calibrate" in done.stdout, done.stderr


@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_tools_help(tool, capsys):
    with pytest.raises(SystemExit) as done:
        main([tool, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith(f"usage: python -m evalkit.calibrate {tool} ") and "--out" in out and "--model" in out


@pytest.mark.parametrize(
    "argv, said",
    [
        ([], "the following arguments are required: TOOL"),
        (["qfilters", "--out", "x"], "invalid choice: 'qfilters'"),
        (["kvzap"], "the following arguments are required: --out"),
        (["lukv", "--out", "x", "--steps", "3"], "unrecognized arguments: --steps 3"),
        (["qfilter", "--out", "x", "--depths", "1.5"], "--depths [1.5]: give depths in [0, 1]"),
        (["ea_stats", "--out", "x", "--lengths", "0"], "--lengths: give a whole number of at least 1"),
        (["restorekv", "--out", "x", "--budget", "1"], "--budget 1.0: give the kept share"),
        (["fastkvzip", "--out", "x", "--steps", "-1"], "--steps: give a whole number of at least 0"),
        (["qfilter", "--out", "x", "--model", "smollm2"], "--model 'smollm2': unknown model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("evalkit: error: ") and said in err, err


def test_qfilter_writes_the_tiny_filters_again(tmp_path):
    assert main(["qfilter", *TINY, "--out", str(tmp_path)]) == 0
    stored = WEIGHTS_TINY["qfilter"]
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((stored / "config.json").read_text())
    new, old = load_file(tmp_path / "model.safetensors"), load_file(stored / "model.safetensors")
    torch.testing.assert_close(new["q_filters"], old["q_filters"], atol=1e-5, rtol=1e-4)


def test_ea_stats_writes_the_tiny_statistics_again(tmp_path):
    assert main(["ea_stats", *TINY, "--out", str(tmp_path)]) == 0
    new, old = (
        load_file(tmp_path / "model.safetensors"),
        load_file(WEIGHTS_TINY["expected_attention_stats"] / "model.safetensors"),
    )
    assert new.keys() == old.keys() == {"query_mean", "query_cov"}
    for key in new:
        torch.testing.assert_close(new[key], old[key], atol=1e-4, rtol=1e-4)


def test_lukv_writes_the_tiny_curve_again(tmp_path):
    out = tmp_path / "curve.npy"
    assert main(["lukv", *TINY, "--out", str(out)]) == 0
    np.testing.assert_allclose(np.load(out), np.load(WEIGHTS_TINY["lukv"]), atol=1e-6)


def test_kvzap_writes_the_tiny_surrogates_again(tmp_path):
    assert main(["kvzap", *TINY, "--out", str(tmp_path)]) == 0
    stored = WEIGHTS_TINY["kvzap"]
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((stored / "config.json").read_text())
    new, old = load_file(tmp_path / "model.safetensors"), load_file(stored / "model.safetensors")
    assert new.keys() == old.keys()
    for key in new:
        torch.testing.assert_close(new[key], old[key], atol=1e-3, rtol=1e-3)


def test_restorekv_seeded_start_is_the_tiny_folder_again(tmp_path):
    assert main(["restorekv", "--model", "tiny-random", "--out", str(tmp_path), "--steps", "0"]) == 0
    stored = WEIGHTS_TINY["restorekv"]
    for name in ("adapter_config.json",):
        assert json.loads((tmp_path / name).read_text()) == json.loads((stored / name).read_text())
    for name in ("restore_embeddings.safetensors", "adapter_model.safetensors"):
        new, old = load_file(tmp_path / name), load_file(stored / name)
        assert new.keys() == old.keys()
        for key in new:
            torch.testing.assert_close(new[key], old[key], atol=0, rtol=0)


def test_fastkvzip_writes_gates_of_the_tiny_files_layout(tmp_path):
    """Trained gates differ with the steps; their layout is the stored file's: a state dict per layer, same shapes."""
    out = tmp_path / "gates.pt"
    assert main(["fastkvzip", *TINY, "--out", str(out), "--steps", "1"]) == 0
    new = torch.load(out, weights_only=True)["module"]
    old = torch.load(WEIGHTS_TINY["fastkvzip"], weights_only=True)["module"]
    assert [{k: v.shape for k, v in g.items()} for g in new] == [{k: v.shape for k, v in g.items()} for g in old]
