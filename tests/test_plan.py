"""evalkit.plan against the worked numbers of the field, from hand-written configs in tests/data/plan.

Every expected value is derived by hand in the test (or taken from the published architecture and parameter counts,
named beside it), never from evalkit.plan itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from evalkit.arch import Arch, arch_from_config, kv_bytes_per_sequence, kv_bytes_per_token
from evalkit.capacity import capacity, free_bytes, sequences
from evalkit.cli.spec import model_spec
from evalkit.errors import ConfigError
from evalkit.params import count_params, metadata_params
from evalkit.plan.guide import capacity_rows
from evalkit.plan.measured import failed_cells
from evalkit.plan.pressure import crossover_context, link_seconds, offload, pressure
from evalkit.plan.settings import Settings, settings
from evalkit.sources import read_source
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "plan"
KiB, MiB, GiB = 2**10, 2**20, 2**30


def arch(name: str, **override) -> Arch:
    raw = json.loads((DATA / f"{name}.json").read_text())
    return arch_from_config({**raw, **override}, name)


def run_plan(*args: str, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "evalkit.plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# --- KV bytes per token and per sequence ---------------------------------------------------------------------------


def test_70b_kv_per_token_mha_gqa_fp8():
    """2 x 80 layers x 64 heads x 128 x 2 bytes = 2,621,440 B = 2.5 MiB as MHA; 8 KV heads: 320 KiB; FP8 halves it:
    160 KiB. Catches a factor of 2 for keys and values dropped, query heads used for KV heads, or dtype ignored."""
    assert kv_bytes_per_token(arch("llama3_70b", num_key_value_heads=64)) == 2.5 * MiB
    assert kv_bytes_per_token(arch("llama3_70b")) == 320 * KiB
    assert kv_bytes_per_token(arch("llama3_70b"), "fp8") == 160 * KiB


def test_llama2_70b_mha_sequence_at_4096_is_10_7_gb():
    """2.5 MiB x 4096 tokens = 10,737,418,240 B: 10.7 GB (decimal), 10 GiB."""
    per_seq = kv_bytes_per_sequence(arch("llama2_70b_mha"), 4096, 2)
    assert per_seq == 10_737_418_240
    assert round(per_seq / 1e9, 1) == 10.7


def test_mistral_sliding_window_caps_the_sequence():
    """32 layers x 8 KV heads x 128 x 2 (K,V) x 2 bytes = 128 KiB a token; at 128k tokens 16 GiB with full attention,
    4096 x 128 KiB = 0.5 GiB with the window: 32x. Catches a window not applied, or applied to a full-attention run."""
    a = arch("mistral_7b")
    assert a.sliding_layers == 32 and a.window == 4096
    full = kv_bytes_per_sequence(a, 131072, 2, window=False)
    windowed = kv_bytes_per_sequence(a, 131072, 2)
    assert full == 16 * GiB
    assert windowed == 0.5 * GiB
    assert full / windowed == 32


def test_gemma3_sliding_layers_capped_global_layers_full():
    """Gemma-3-270M: 18 layers, 1 KV head x 256 dims: 2 x 256 x 2 = 1024 B per layer and token. Layers 5, 11, 17 are
    global (every 6th), the other 15 slide over 512 tokens. At 32768 tokens: 3 x 32768 x 1024 + 15 x 512 x 1024 B;
    under the window (100 tokens) every layer holds all: 18 x 100 x 1024. Catches the layer pattern misread (all
    sliding or all global), or the cap applied to global layers."""
    a = arch("gemma3_270m")
    assert [i for i, s in enumerate(a.sliding) if not s] == [5, 11, 17]
    assert kv_bytes_per_sequence(a, 32768, 2) == 3 * 32768 * 1024 + 15 * 512 * 1024
    assert kv_bytes_per_sequence(a, 100, 2) == 18 * 100 * 1024
    assert kv_bytes_per_token(a) == 18 * 1024  # MQA: one KV head


def test_sliding_pattern_of_an_older_gemma3_config_and_qwen2():
    """Without layer_types, Gemma 3's sliding_window_pattern=6 makes every 6th layer global; Qwen2 declares a window
    but use_sliding_window=false: no layer slides. Catches the window applied to every layer of these."""
    raw = json.loads((DATA / "gemma3_270m.json").read_text())
    raw.pop("layer_types")
    old = arch_from_config({**raw, "sliding_window_pattern": 6}, "g")
    assert [i for i, s in enumerate(old.sliding) if not s] == [5, 11, 17]
    qwen = arch("mistral_7b", model_type="qwen2", use_sliding_window=False)
    assert qwen.sliding_layers == 0 and qwen.window is None


def test_mla_caches_the_latent_and_rope_key():
    """DeepSeek-V3: per layer and token kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements, 61 layers, bf16:
    576 x 61 x 2 = 70,272 B. DeepSeek-V2 (section 2.1.3) states MLA's cache equals GQA with 2.25 groups of head_dim
    128: 2 x 2.25 x 128 = 576. Catches MLA read as MHA (2 x 128 heads x 128 per layer) or the RoPE key left out."""
    a = arch("deepseek_v3")
    assert kv_bytes_per_token(a) == 576 * 61 * 2 == 70_272
    assert a.per_layer_elements == 2 * 2.25 * 128


def test_smollm2_config_bytes_per_token():
    """SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040 B a token in fp16/bf16. (Measured in a real
    run: see test_tiny_run_records_match_the_plan for CI; SmolLM2 by hand in the report.)"""
    assert kv_bytes_per_token(arch("smollm2_135m")) == 23_040


# --- weights --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, published",
    [
        ("mistral_7b", 7_241_732_096),  # Hugging Face's count of Mistral-7B-v0.1
        ("smollm2_135m", 134_515_008),  # Hugging Face's count of SmolLM2-135M (also the GGUF's tensor shapes)
    ],
)
def test_params_from_config_match_published_counts(name, published):
    """Parameters computed from the config equal the published exact counts. Catches a tied head counted twice,
    GQA's K/V projections sized as MHA's, or the MLP's third matrix left out."""
    assert count_params(arch(name)) == (published, published)


def test_params_of_70b_and_moe_within_published_rounding():
    """Llama-3-70B: 70.6B published; DeepSeek-V3: 671B total, 37B activated a token (arXiv:2412.19437). Catches
    routed experts not counted, or every expert counted as active."""
    total, _ = count_params(arch("llama3_70b"))
    assert abs(total / 70.6e9 - 1) < 0.001
    total, active = count_params(arch("deepseek_v3"))
    assert abs(total / 671e9 - 1) < 0.001
    assert abs(active / 37e9 - 1) < 0.03


def test_safetensors_metadata_counts_without_reading_tensors(tmp_path):
    """A folder's index total_size (bytes in the stored dtype) gives the parameter count: 141,106,823,168 bytes of
    bf16 are 70,553,411,584 parameters; a single file's header alone (its tensors absent) counts 6 + 12 parameters."""
    raw = {"torch_dtype": "bfloat16"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 141_106_823_168}}))
    assert metadata_params(tmp_path, raw)[0] == 70_553_411_584
    single = tmp_path / "one"
    single.mkdir()
    header = json.dumps({"a": {"shape": [2, 3]}, "b": {"shape": [12]}, "__metadata__": {}}).encode()
    (single / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)  # no tensor data at all
    assert metadata_params(single, raw)[0] == 18


# --- capacity, pressure, offload -------------------------------------------------------------------------------------


def test_capacity_at_8k_on_640_gib_with_141_gib_weights():
    """(640 - 141) GiB free; MHA: 2.5 MiB x 8192 = 20 GiB a sequence -> 499 / 20 = 24.95: 24 sequences; GQA-8: 2.5 GiB
    -> 199 (about 8x); FP8: 1.25 GiB -> 399 (2x more). Catches weights not subtracted or a floor turned into a round."""
    free = free_bytes(640, 141 * GiB)
    mha = kv_bytes_per_sequence(arch("llama3_70b", num_key_value_heads=64), 8192, 2)
    gqa = kv_bytes_per_sequence(arch("llama3_70b"), 8192, 2)
    fp8 = kv_bytes_per_sequence(arch("llama3_70b"), 8192, 1)
    assert [sequences(free, x) for x in (mha, gqa, fp8)] == [24, 199, 399]


def test_utilization_and_prefix_sharing():
    """10 GiB at utilization 0.5 with 1 GiB of weights leaves 4 GiB; sequences of 1 GiB: 4. With half of every
    sequence a shared prefix held once: (4 - 0.5) / 0.5 = 7. Catches utilization ignored, or the prefix not held."""
    free = free_bytes(10, 1 * GiB, 0.5)
    assert free == 4 * GiB
    assert sequences(free, GiB) == 4
    assert sequences(free, GiB, shared=0.5) == 7


def test_offload_30_gb_at_50_gbps_is_600_ms():
    """30 GB of KV over a 50 GB/s link: 0.6 s. With 3000 GB/s HBM and 70 GB of weights, a step reads 100 GB in
    33.3 ms: the link hides 33.3 ms x 50 GB/s = 1.67 GB of the 30 GB, a cold share of 5.6%."""
    assert link_seconds(30e9, 50) == pytest.approx(0.6)
    o = offload(30e9, 70e9, 3000, 50)
    assert o["link_seconds"] == pytest.approx(0.6)
    assert o["compute_seconds"] == pytest.approx(100 / 3000)
    assert o["cold_fraction"] == pytest.approx((100 / 3000) * 50 / 30)
    assert o["verdict"].startswith("not viable")


def test_pressure_and_crossover():
    """Llama-3-70B at bf16 (141,107,412,992 B of weights from 70,553,706,496 parameters): 32 sequences of 8192 tokens
    hold 32 x 2.5 GiB = 80 GiB: 0.609x, weight-bound; the crossover at batch 32 is 141.1e9 / (32 x 320 KiB) tokens.
    Gemma-3's crossover is past the window: the sliding layers count 512 tokens. Catches KV and weights swapped."""
    a = arch("llama3_70b")
    w = 70_553_706_496 * 2
    p = pressure(a, w, 32, 8192)
    assert p["kv_bytes"] == 80 * GiB and p["bound"] == "weight-bound"
    assert p["ratio"] == pytest.approx(80 * GiB / w)
    assert crossover_context(a, w, 32) == pytest.approx(w / (32 * 320 * KiB))
    g = arch("gemma3_270m")
    c = crossover_context(g, 1e9, 1)
    assert c > 512 and 3 * c * 1024 + 15 * 512 * 1024 == pytest.approx(1e9)
    assert crossover_context(arch("mistral_7b"), 1e12, 1) is None  # every layer slides: never KV-bound alone


def test_gate_capacity_uses_the_plan_arithmetic():
    """The gate's capacity line is capacity: 2^29 free bytes, 1 byte a token, 1000 tokens -> 2^29 // 1000."""
    from evalkit.gate import judge

    assert judge.capacity is capacity
    out = capacity({"v": {"kv_bytes_per_token": 1.0}}, 2**29, 1, 1000)
    assert out["v"]["sequences"] == 2**29 // 1000


def test_cache_root_is_the_models():
    """plan reads the embedded models' converted folder where evalkit.engine.models converts them: one function."""
    from evalkit import sources
    from evalkit.engine import models

    assert sources.converted_folder is models.converted_folder


# --- settings and the command ----------------------------------------------------------------------------------------


def base_settings(**kw) -> Settings:
    node = OmegaConf.load(ROOT / "conf" / "plan.yaml").plan
    node.out = None
    return settings(OmegaConf.to_container(OmegaConf.merge(node, kw)))


@pytest.mark.parametrize(
    "key, value",
    [
        ("gpu_gib", -1),
        ("utilization", 1.5),
        ("batch", 0),
        ("budgets", [1.5]),
        ("link", "usb"),
        ("weight_dtype", "q3"),
        ("gpu_gib", float("nan")),
        ("hbm_gbps", float("nan")),
        ("weights_gib", float("inf")),
        ("link_gbps", float("nan")),
    ],  # fmt: skip
)
def test_bad_settings_are_config_errors(key, value):
    """Each malformed plan value is a ConfigError naming the key (exit 2), not a wrong plan. Before, NaN passed the
    `> 0` check: gpu_gib=nan was exit 3, hbm_gbps=nan printed "viable (4.2 ms <= nan ms)"."""
    with pytest.raises(ConfigError, match=f"plan.{key}"):
        base_settings(**{key: value})


def test_capacity_rows_in_the_guide_order_with_measured_verdicts():
    """Mistral at 32768 tokens, 80 GiB x 0.9, 13.49 GiB of weights computed: the rows come in the guide's order; the
    window row holds 4096/32768 of the paged full cache; a measured variant's row is the full cache times its ratio,
    with its verdict beside it."""
    a = arch("mistral_7b")
    s = base_settings(context=32768)
    free = free_bytes(80, 7_241_732_096 * 2, 0.9)
    measured = [
        {"variant": "h2o@0.25", "kv_ratio": 0.25, "model": "m", "status": "FAIL", "why": "on cells x", "run": "r"}
    ]
    rows = capacity_rows(a, s, free, measured)
    order = [r["option"].split(" ")[0] for r in rows]
    assert order == [
        "contiguous,",
        "full",
        "sliding",
        "prefix",
        "FP8",
        "int4",
        "eviction",
        "eviction",
        "eviction",
        "h2o@0.25",
    ]
    full = 32768 * 128 * KiB
    assert rows[1]["kv_bytes_per_sequence"] == full
    assert rows[2]["kv_bytes_per_sequence"] == full / 8
    assert rows[-1]["kv_bytes_per_sequence"] == full / 4 and rows[-1]["status"] == "FAIL"
    assert rows[-1]["sequences"] == int(free // (full / 4))


def test_cli_plans_a_70b_config_offline(tmp_path):
    """The command on a local 70B config writes plan.json, plan.md and the PNG; plan.json carries the worked
    figures (320 KiB a token, 24 MHA-free sequences are checked above) and the guide's first step."""
    res = run_plan(
        "model=hf",
        f"model.name_or_path={DATA / 'llama3_70b.json'}",
        "plan.gpu_gib=640",
        "plan.weights_gib=141",
        "plan.utilization=1.0",
        f"plan.out={tmp_path}",
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["kv_bytes_per_token"]["bf16"] == 320 * KiB
    assert doc["capacity"][1]["sequences"] == 199  # (640 - 141) GiB / 2.5 GiB
    assert doc["guide"][0]["step"]
    assert (tmp_path / "plan_pressure.png").stat().st_size > 1000
    assert "## Decision guide" in (tmp_path / "plan.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=hf", "model.name_or_path=/nonexistent/config.json"], "model.name_or_path"),
        (["model=smollm3"], "unknown model"),
        (["plan.gpu_gb=80"], "plan.gpu_gb"),
        (["plan.batch=-4"], "plan.batch"),
        (["model=hf"], "model.name_or_path"),
    ],
)
def test_cli_bad_input_exits_2_in_one_line(args, message):
    """A user's mistake: exit 2 with one line naming it, no traceback."""
    res = run_plan(*args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr


# --- against evalkit's own records ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Two real gated runs of the tiny random Llama and Gemma-3 (full cache and a streaming variant)."""
    root = tmp_path_factory.mktemp("plan-runs")
    out = {}
    for model in ("tiny-random", "tiny-random-gemma3"):
        folder = root / model
        res = run_cli(
            f"model={model}",
            "task=needle",
            "task.context_lengths=[128]",
            "task.depths=[0.5]",
            "task.max_new_tokens=2",
            "variants=[streaming_llm@0.5]",
            "gate=default",
            f"hydra.run.dir={folder}",
        )
        assert (folder / "samples.jsonl").is_file(), res.stderr
        out[model] = folder
    return out


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line.strip()]


def test_tiny_run_records_match_the_plan(tiny_runs):
    """The tiny Llama's config (3 layers, 2 KV heads x 16): 2 x 3 x 2 x 16 x 2 = 384 B a token; a real run's baseline
    records that many deployed bytes per context token (summary kv_bytes_per_token), and its weights_bytes (float32)
    are 4 x the parameters the plan computes from the same config."""
    from evalkit.records import read_rows
    from evalkit.records.summary import summarize

    folder = tiny_runs["tiny-random"]
    model = OmegaConf.load(ROOT / "conf" / "model" / "tiny-random.yaml")
    a = arch_from_config(read_source(model_spec(model)).raw, "tiny")
    assert kv_bytes_per_token(a) == 2 * 3 * 2 * 16 * 2 == 384
    assert summarize(read_rows(folder / "samples.jsonl"))["baseline"]["kv_bytes_per_token"] == 384
    info = json.loads((folder / "run.json").read_text())
    assert info["model"]["weights_bytes"] == 4 * count_params(a)[0]


def test_tiny_gemma3_run_matches_the_capped_layers(tiny_runs):
    """The tiny Gemma-3 (4 layers, 3 sliding over 16 tokens, 2 KV heads x 16, 128 bytes per layer-token in fp16):
    the plan gives 1 x n x 128 + 3 x 16 x 128 bytes at n context tokens; transformers holds window - 1 = 15 tokens in
    a sliding layer between steps (its mask counts the current token in the window), 3 x 128 bytes less, which the
    record shows."""
    folder = tiny_runs["tiny-random-gemma3"]
    row = next(r for r in _rows(folder) if r["variant"] == "baseline")
    n = row["context_tokens"]
    model = OmegaConf.load(ROOT / "conf" / "model" / "tiny-random-gemma3.yaml")
    a = arch_from_config(read_source(model_spec(model)).raw, "tiny-gemma3")
    assert kv_bytes_per_sequence(a, n, 2) == n * 128 + 3 * 16 * 128
    assert row["kv_bytes_baseline_deployed"] == kv_bytes_per_sequence(a, n, 2) - 3 * 128


def test_plan_runs_show_each_variant_beside_its_verdict(tiny_runs, tmp_path):
    """plan.runs=[two gated runs]: each variant's row uses its measured ratio, the one the gate judges (the cache its
    answer was decoded from at its largest over the full cache's: streaming_llm@0.5 holds about half the
    full-attention layers' context, and the question and answer beside it) and carries the gate's status from the
    run's verdict.json."""
    runs = [str(tiny_runs["tiny-random"]), str(tiny_runs["tiny-random-gemma3"])]
    res = run_plan("model=tiny-random", f"plan.runs=[{','.join(runs)}]", f"plan.out={tmp_path}")
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    measured = [r for r in doc["capacity"] if "measured" in r["option"]]
    assert len(measured) == 2
    for r, folder in zip(measured, runs, strict=True):
        verdict = json.loads((Path(folder) / "verdict.json").read_text())
        assert r["run"] == folder and r["status"] in (verdict["verdict"], "CANNOT JUDGE")
        row = next(x for x in _rows(Path(folder)) if x["variant"] != "baseline")
        ratio = row["decode_peak_kv_bytes_deployed"] / row["decode_peak_kv_bytes_baseline_deployed"]
        assert ratio > row["kv_bytes_deployed"] / row["kv_bytes_baseline_deployed"]  # not the context's
        assert r["kv_bytes_per_sequence"] == pytest.approx(doc["capacity"][1]["kv_bytes_per_sequence"] * ratio)
    assert "streaming_llm@0.5" in (tmp_path / "plan.md").read_text()


def test_only_cells_shown_to_fail_are_listed_as_failing():
    """A verdict's cells: one shown to fail, one with no failure shown, one not judged ("a failure here can be shown
    from 7"): only the first is a failing cell. Matching the word "fail" would list all three (the plan once said
    "FAIL on cells ..." beside an INCONCLUSIVE int8 run whose cells were all not judged)."""
    verdict = {
        "cells": [
            {"variant": "v", "cell": "a", "status": "shown to fail"},
            {"variant": "v", "cell": "b", "status": "no failure shown"},
            {"variant": "v", "cell": "c", "status": "not judged: 2 samples, a failure here can be shown from 7"},
            {"variant": "w", "cell": "a", "status": "shown to fail"},
        ]
    }
    assert failed_cells(verdict, "v") == ["a"]
    assert failed_cells(verdict, "x") == []


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("intermediate_size", "x", "intermediate_size='x' in its config; give a whole number >= 1"),
        ("max_position_embeddings", "x", "max_position_embeddings='x' in its config; give a whole number >= 1"),
        ("kv_lora_rank", "512", "kv_lora_rank='512' in its config; give a whole number >= 0"),
        ("vocab_size", "32000", "vocab_size='32000' in its config; give a whole number >= 1"),
        ("vocab_size", -5, "vocab_size=-5 in its config; give a whole number >= 1"),
        ("sliding_window", "4096", "sliding_window='4096' in its config; give a whole number >= 0"),
        ("tie_word_embeddings", "no", "tie_word_embeddings='no' in its config; give true or false"),
        ("layer_types", ["sliding_attention", "full_attention"], "layer_types is a list of 2 in its config, not one"),
    ],
)
def test_config_fields_that_are_not_what_they_claim_are_one_line(tmp_path, field, value, message):
    """Mistral's config with one field spoiled. Before: a string count was exit 3 (int('x')) or read as a number
    ('32000'), 'no' read as a tied head (bool('no') is True), vocab_size -5 gave negative parameters, and a short
    layer_types list was ignored (every layer then taken as sliding)."""
    raw = {**json.loads((DATA / "mistral_7b.json").read_text()), field: value}
    with pytest.raises(ConfigError) as err:
        arch_from_config(raw, "spoiled")
    assert str(err.value).startswith(f"model spoiled: {message}")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw))
    res = run_plan("model=hf", f"model.name_or_path={config}", f"plan.out={tmp_path / 'out'}")
    said = f"evalkit: error: model config.json: {message}"
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith(said), res.stderr
    assert arch_from_config(json.loads((DATA / "mistral_7b.json").read_text()), "mistral").vocab == 32000  # control


def test_the_console_prints_user_text_as_written_not_as_rich_markup(monkeypatch, capsys):
    """A variant list is user text: Rich read `variants=[snapkv@0.25]` as a markup tag and printed `variants=`."""
    from evalkit.plan import outputs

    table = {"measured [runs]": (["variant", "verdict"], [["variants=[snapkv@0.25]", "[bold]PASS"]])}
    monkeypatch.setattr(outputs, "tables", lambda p: table)
    outputs.print_console({"offload": {"verdict": "[red]viable"}})
    out = capsys.readouterr().out
    for text in ("measured [runs]", "variants=[snapkv@0.25]", "[bold]PASS", "Offload: [red]viable"):
        assert text in out, out
