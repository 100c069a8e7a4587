"""Bad input is refused in one line with exit 2, naming the row or field and the fix; a bug before the model loads is
exit 3 with the bug-report line, never exit 1 (the gate's FAIL). Each case below was once taken silently, or refused
with a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from evalkit.arch import arch_from_config
from evalkit.cli import precheck as precheck_module
from evalkit.cli.lmeval import CommandLineLM, model_config
from evalkit.cli.main import main as evalkit_main
from evalkit.errors import ConfigError
from evalkit.gate.judge import extend_command
from evalkit.lmeval.metrics import choose_metrics
from evalkit.plan.settings import settings as plan_settings
from evalkit.tasks.hf import HfTask
from tests.conftest import ROOT

TINY = ["model=tiny-random"]


def evalkit(capsys, monkeypatch, tmp_path: Path, *args: str) -> tuple[int, str]:
    """`python -m evalkit ARGS` in this process: (exit code, stderr). The cases here stop before any model loads."""
    monkeypatch.setattr(sys, "argv", ["evalkit", *TINY, *args, f"results_root={tmp_path / 'results'}"])
    with pytest.raises(SystemExit) as stop:
        evalkit_main()
    return stop.value.code, capsys.readouterr().err


def one_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("evalkit: error: "), err
    return lines[0]


# --- task=hf ----------------------------------------------------------------------------------------------------


def test_csv_answers_are_read_as_text(tmp_path):
    """CSV type guessing read the answer 00731 as 731.0, which no right answer can ever contain."""
    path = tmp_path / "codes.csv"
    path.write_text('context,question,answer,max_new_tokens\n"The code is 00731.",What is the code?,00731,8\n')
    (row,) = HfTask(path=str(path)).read()
    assert row.sample.answers == ["00731"] and row.max_new_tokens == 8


@pytest.mark.parametrize(
    ("name", "data", "args", "message"),
    [
        ("nan.jsonl", b'{"context": "c", "question": "q", "answer": NaN}\n', [], "row 0: column 'answer' must be"),
        (
            "latin.jsonl",
            b'{"context": "caf\xe9", "question": "q", "answer": "x"}\n',
            [],
            "latin.jsonl:1: not UTF-8 text (byte 0xe9 at column 17); save the file as UTF-8",
        ),
        ("empty.jsonl", b"", [], "holds no rows (the file is empty)"),
        ("header.csv", b"context,question,answer\n", [], "holds no rows (a header line only)"),
        (
            "broken.jsonl",
            b'{"context": "c", "question": "q", "answer": "x"}\n{"context": oops}\n',
            [],
            "broken.jsonl:2: not valid JSON (Expecting value at column 13); fix the line",
        ),
        (
            "list.jsonl",
            b'{"context": "c", "question": "q", "answer": "x"}\n',
            ["task.columns.context=[a,b]"],
            "task.columns.context=['a', 'b']: name one column of the dataset",
        ),
        (
            "null.jsonl",
            b'{"context": "c", "question": "q", "answer": "x"}\n',
            ["task.columns.question=null"],
            "task.columns.question=null: every sample needs its question",
        ),
    ],
    ids=["nan-answer", "not-utf8", "empty", "header-only", "generator-error", "list-column", "null-question"],
)
def test_bad_datasets_are_refused_naming_the_row_or_field(capsys, monkeypatch, tmp_path, name, data, args, message):
    """Before: NaN became the answer 'nan'; a non-UTF-8 file or a list for a column was a traceback with exit 1 (the
    FAIL code); an empty dataset or a bad line surfaced as StopIteration or DatasetGenerationError naming no row;
    question=null said "column None is missing"."""
    (tmp_path / name).write_bytes(data)
    code, err = evalkit(capsys, monkeypatch, tmp_path, "task=hf", f"task.path={tmp_path / name}", *args)
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def test_an_empty_saved_dataset_is_refused(capsys, monkeypatch, tmp_path):
    Dataset.from_dict({"context": [], "question": [], "answer": []}).save_to_disk(tmp_path / "ds")
    capsys.readouterr()  # the progress bar of save_to_disk
    code, err = evalkit(capsys, monkeypatch, tmp_path, "task=hf", f"task.path={tmp_path / 'ds'}")
    assert "holds no rows (a dataset saved empty)" in one_line(code, err)  # before: IndexError naming nothing


def test_a_rows_own_answer_budget_is_named(tmp_path):
    """A row asking 10^9 new tokens was blamed on task.max_new_tokens."""
    from evalkit.embedded import byte_tokenizer

    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"context": "c", "question": "q", "answer": "x", "max_new_tokens": 10**9}) + "\n")
    task = HfTask(path=str(path), context_window=4096)
    task.validate()
    with pytest.raises(ConfigError, match=r"row 0 of .*big.jsonl: column 'max_new_tokens' asks for 1000000000 new"):
        task.samples(byte_tokenizer())


def test_needle_cells_say_the_length_the_essay_gave(tmp_path):
    """An essay of 300 byte-level tokens cannot fill the 100000 asked: the cell says what it gave (the essay, the
    needle and the 150 tokens kvpress leaves for the template), not 100000."""
    from evalkit.embedded import byte_tokenizer

    essay, needle = "a" * 300, "The best thing is a sandwich."
    Dataset.from_dict({"context": [essay], "question": ["q"], "needle": [needle]}).save_to_disk(tmp_path / "d")
    task = HfTask(path=str(tmp_path / "d"), needle_depths=[50.0], needle_context_length=100_000, scorer="needle")
    task.validate()
    (sample,) = task.samples(byte_tokenizer())
    tokens = len(byte_tokenizer().encode(essay, add_special_tokens=False))
    assert sample.cell["context_length"] == tokens + len(needle) + 150 == 479


# --- the INCONCLUSIVE advice works as printed -----------------------------------------------------------------------


def test_the_advice_is_the_command_that_extends_the_run_in_its_folder():
    """`task.limit=59 resume=true` alone named another folder (the limit is in the folder's name) and, before, was
    refused by resume because limit was part of the run's identity: the advice is now the whole command."""
    info = {
        "command": ["/x/evalkit/__main__.py", "task=hf", "task.path=d.jsonl", "task.limit=20", "policy=snapkv"],
        "_folder": "/r/hf/run",
    }
    assert extend_command(info, "task.limit=59") == (
        "python -m evalkit task=hf task.path=d.jsonl policy=snapkv task.limit=59 resume=true hydra.run.dir=/r/hf/run"
    )
    assert extend_command({**info, "command": ["lm_eval", "--limit", "3"]}, "task.limit=59") is None


def test_a_larger_limit_resumes_the_same_experiment(tmp_path):
    """limit, fraction and samples_per_cell say how many samples, not which: not part of the run's identity."""
    from evalkit.run.resume import _identity

    a = {"task": {"name": "hf", "path": "d", "limit": 20, "fraction": 1.0}, "seed": 0}
    b = {"task": {"name": "hf", "path": "d", "limit": 59, "fraction": 0.5}, "seed": 0}
    assert _identity(a) == _identity(b) and _identity(a) != _identity({**b, "seed": 1})


# --- lm-eval's command line -------------------------------------------------------------------------------------


def test_unknown_model_args_and_models_are_refused(tiny):
    """`--model_args ...,varient=snapkv@0.5` ran the default none@1.0 (unknown keys swallowed); model=nosuch was
    exit 3; metric=bogus was blamed on task.metric, a key of the other route."""
    with pytest.raises(ConfigError, match=r"--model_args varient=...: the evalkit model takes no 'varient' \(did you "):
        CommandLineLM(model="tiny-random", varient="snapkv@0.5")
    with pytest.raises(ConfigError, match=r"--model_args model='smolm2': unknown model \(did you mean smollm2-135m"):
        model_config("smolm2")
    from evalkit.lmeval.evaluate import load_tasks
    from evalkit.tasks.lmeval_index import task_manager

    manager = task_manager(["evalkit_recall"])
    tasks = manager.load(load_tasks(manager, ["evalkit_recall"]))["tasks"]
    with pytest.raises(ConfigError, match=r"^--model_args metric='bogus': lm-eval task 'evalkit_recall' logs"):
        choose_metrics(tasks, "bogus", "--model_args metric")


def test_the_lm_eval_command_line_refuses_a_misspelt_argument_with_2():
    result = subprocess.run(
        [sys.executable, "-m", "evalkit.lmeval", "run", "--model", "evalkit", "--model_args",
         "model=tiny-random,varient=snapkv@0.5", "--tasks", "evalkit_recall", "--limit", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "evalkit: error: --model_args varient=...: the evalkit model takes no 'varient'" in result.stderr


# --- python -m evalkit.plan ---------------------------------------------------------------------------------------


BASE = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"num_key_value_heads": 0}, "num_key_value_heads=0 in its config; give a whole number >= 1"),
        ({"num_key_value_heads": 16}, "num_key_value_heads=16 does not divide num_attention_heads=8"),
        ({"num_attention_heads": 7}, "hidden_size 512 is not a multiple of num_attention_heads 7"),
        ({"num_attention_heads": 0}, "num_attention_heads=0 in its config"),
        ({"num_hidden_layers": -2}, "num_hidden_layers=-2 in its config"),
    ],
    ids=["zero-kv-heads", "more-kv-than-query-heads", "head-dim-not-whole", "zero-heads", "negative-layers"],
)
def test_impossible_model_configs_are_refused(override, message):
    """Before: 0 KV heads was taken as MHA, 16 KV heads over 8 query heads printed GQA-16, hidden 512 over 7 heads
    gave head_dim 73, and 0 heads or negative layers were exit 3."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        arch_from_config({**BASE, **override}, "m")


def test_a_p95_context_below_the_median_is_refused():
    from omegaconf import OmegaConf

    node = OmegaConf.load(ROOT / "conf" / "plan.yaml").plan
    node.context, node.p95_context = 8192, 4096
    with pytest.raises(ConfigError, match="plan.p95_context=4096 is below plan.context=8192"):
        plan_settings(OmegaConf.to_container(node))


# --- a bug before the model loads -----------------------------------------------------------------------------------


def test_a_bug_in_the_precheck_is_exit_3_with_the_report_line(capsys, monkeypatch, tmp_path):
    """Any exception in __main__'s pre-check exited 1, the gate's FAIL code."""

    def bug(argv):
        raise RuntimeError("a bug")

    monkeypatch.setattr(precheck_module, "precheck", bug)
    code, err = evalkit(capsys, monkeypatch, tmp_path, "task=needle")
    assert code == 3 and "RuntimeError: a bug" in err and "internal error (a bug in evalkit" in err
