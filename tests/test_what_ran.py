"""What a PASS claims is what ran: the bytes judged are those of the cache each answer was decoded from (not the
context's right after compression), and a variant's label is the policy that ran (its class and settings), not a
name typed beside it. Every case runs the tiny random model through evalkit itself and judges the folder it wrote.

Expected bytes are derived by hand from the model's shape: a dense layer holds 2 (keys, values) x kv_heads x
head_dim values per token, 2 bytes each as deployed (fp16); greedy decoding feeds the question, then each generated
token but the last, so the cache an answer is decoded from holds, at its largest, the kept context plus the question
plus all but one of the generated tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers.cache_utils import DynamicLayer

from evalkit.cli.config import variants
from evalkit.cli.gate import main
from evalkit.kv.cache import fp16_layer_bytes
from evalkit.records import read_rows
from evalkit.records.labels import compression_asked, row_label, variant_label
from tests.conftest import ROOT, compose_config
from tests.test_judged_records import real_run

TINY = yaml.safe_load((ROOT / "conf" / "model" / "tiny-random.yaml").read_text())["config"]
# bytes per token held in every layer, as deployed: keys and values, fp16
PER_TOKEN = TINY["num_hidden_layers"] * 2 * TINY["num_key_value_heads"] * TINY["head_dim"] * 2
N = 24  # contexts, one question each: 24 answers kept bound the drop by 1 - 0.05 ** (1 / 24) = 0.117 < 0.3
# The tiny random model answers in bytes that are not UTF-8: every answer, the full cache's and each variant's,
# holds U+FFFD, so every row scores 1 and the verdict turns on the bytes alone
ANSWER = "\ufffd"
CONTEXT = "the river runs past stone and cloud and then back again"  # 55 characters: the byte tokenizer's tokens
QUESTION = "Tell me, in your own words and at some length, " * 12  # most of the prompt is the question
LOOSE = "max_drop: 0.3\nmax_flip_rate: 0.3\nmin_cell_accuracy: null\nmax_mean_kl: null\n"


def long_questions(path: Path) -> Path:
    with path.open("w") as f:
        for i in range(N):
            row = {"id": f"q{i}", "context": f"{CONTEXT} {i}", "question": QUESTION, "answers": [ANSWER]}
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("what_ran")
    data = long_questions(root / "long_questions.jsonl")
    (root / "gate.yaml").write_text(LOOSE + "min_compression: 0.5\n")
    return {
        "streaming": real_run(
            root / "streaming", data, "policy=streaming_llm", "policy.decode=false", "policy.budget=0.25"
        ),
        "renamed": real_run(root / "renamed", data, "policy=none", "policy.name=snapkv", "+policy.budget=0.25"),
        "gate": root / "gate.yaml",
    }


def judge(capsys, gate: Path, folder: Path, *args: str) -> tuple[int, str, str]:
    code = main([str(folder), "--gate", str(gate), *args])
    out, err = capsys.readouterr()
    return code, out, err


def variant_rows(folder: Path) -> list[dict]:
    return [r for r in read_rows(folder / "samples.jsonl") if r["variant"] != "baseline"]


def test_the_bytes_recorded_are_the_decoded_cache_at_its_largest(runs):
    """Each row's decoded-from peak is (kept context + question + generated - 1) tokens at PER_TOKEN bytes, the
    baseline's the same over the whole context; the context-only figures are the kept context's and the whole's."""
    rows = read_rows(runs["streaming"] / "samples.jsonl")
    generated = {r["sample_id"]: r["generated_tokens"] for r in rows if r["variant"] == "baseline"}
    for r in variant_rows(runs["streaming"]):
        n, question = r["context_tokens"], r["prompt_tokens"] - r["context_tokens"]
        kept = r["tokens_held_per_layer"][0]
        assert r["tokens_held_per_layer"] == [kept] * TINY["num_hidden_layers"] and kept < n
        assert r["kv_bytes_deployed"] == kept * PER_TOKEN and r["kv_bytes_baseline_deployed"] == n * PER_TOKEN
        assert r["decode_peak_kv_bytes_deployed"] == (kept + question + r["generated_tokens"] - 1) * PER_TOKEN
        baseline = (n + question + generated[r["sample_id"]] - 1) * PER_TOKEN
        assert r["decode_peak_kv_bytes_baseline_deployed"] == baseline


def test_min_compression_judges_the_decoded_cache_not_the_context(runs, capsys, tmp_path):
    """Before: the context's ratio (about 0.25x) was judged and printed, and the run PASSed min_compression 0.5;
    the cache decoded from holds the long question too, over half the full cache's: FAIL, with both figures shown."""
    rows = variant_rows(runs["streaming"])
    decoded = sum(r["decode_peak_kv_bytes_deployed"] / r["decode_peak_kv_bytes_baseline_deployed"] for r in rows)
    context = sum(r["kv_bytes_deployed"] / r["kv_bytes_baseline_deployed"] for r in rows)
    decoded, context = decoded / len(rows), context / len(rows)
    assert context < 0.5 <= decoded  # the data make the two figures fall either side of the threshold
    code, out, _ = judge(capsys, runs["gate"], shutil.copytree(runs["streaming"], tmp_path / "s"))
    assert code == 1 and "evalkit gate: FAIL" in out, out
    assert f"compression was asked but its KV bytes are {decoded:.3f}x the full cache's" in out, out
    report = (tmp_path / "s" / "report.md").read_text()
    assert f"| {decoded:.3f}x | {context:.3f}x |" in report, report  # the judged figure, then the context's
    verdict = json.loads((tmp_path / "s" / "verdict.json").read_text())
    (s,) = [v for k, v in verdict["variants"].items() if k != "baseline"]
    assert s["kv_ratio"] == pytest.approx(decoded) and s["kv_ratio_context"] == pytest.approx(context)


def test_the_same_run_passes_where_the_decoded_cache_is_small_enough(runs, capsys, tmp_path):
    """The control: at min_compression 0.99 (the default) the decoded cache is small enough and the run PASSes."""
    gate = tmp_path / "loose.yaml"
    gate.write_text(LOOSE)
    code, out, _ = judge(capsys, gate, shutil.copytree(runs["streaming"], tmp_path / "s"))
    assert code == 0 and "evalkit gate: PASS" in out, out


def test_a_full_cache_named_snapkv_is_labelled_by_what_ran(runs, capsys, tmp_path):
    """Before: `policy=none policy.name=snapkv +policy.budget=0.25` wrote rows labelled snapkv@0.25 and PASSed as
    snapkv at 1.000x. Now the rows record the class that ran, the label says it is the full cache (the name typed
    stands beside it) and the gate, seeing no compression asked of a full cache, judges it as one."""
    rows = variant_rows(runs["renamed"])
    assert {r["variant"] for r in rows} == {"none[snapkv]@0.25"}
    assert all(r["policy"]["class"] == "evalkit.policies.none.FullCache" for r in rows)
    assert all(r["policy"]["name"] == "snapkv" and r["policy"]["budget"] == 0.25 for r in rows)
    code, out, _ = judge(capsys, runs["gate"], shutil.copytree(runs["renamed"], tmp_path / "r"))
    assert code == 0 and "none[snapkv]@0.25" in out and "snapkv@0.25 " not in out, out


def rows_of(folder: Path) -> list[dict]:
    """The rows as written, plain objects to edit as a user would."""
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def relabel(folder: Path, old: str, new: str) -> None:
    rows = rows_of(folder)
    text = "".join(json.dumps({**r, "variant": new if r["variant"] == old else r["variant"]}) + "\n" for r in rows)
    (folder / "samples.jsonl").write_text(text)


def test_a_label_edited_to_another_policy_is_refused(runs, capsys, tmp_path):
    """The same rows relabelled snapkv@0.25 by hand: their record derives none[snapkv]@0.25. CANNOT JUDGE."""
    d = Path(shutil.copytree(runs["renamed"], tmp_path / "r"))
    relabel(d, "none[snapkv]@0.25", "snapkv@0.25")
    code, out, err = judge(capsys, runs["gate"], d)
    assert code == 2 and "CANNOT JUDGE" in out and len(err.strip().splitlines()) == 1, (out, err)
    assert "is labelled 'snapkv@0.25' but records evalkit.policies.none.FullCache" in out, out


def test_compression_asked_false_written_by_hand_is_not_believed(runs, capsys, tmp_path):
    """Before: `compression_asked: false` written on a compressing variant's rows took it out of min_compression
    (a FAIL became a PASS). The gate derives it from the class and budget: still FAIL."""
    d = Path(shutil.copytree(runs["streaming"], tmp_path / "s"))
    rows = rows_of(d)
    text = "".join(json.dumps({**r, "compression_asked": False}) + "\n" for r in rows)
    (d / "samples.jsonl").write_text(text)
    code, out, _ = judge(capsys, runs["gate"], d)
    assert code == 1 and "compression was asked" in out, out


@pytest.mark.parametrize("field", ["decode_peak_kv_bytes_deployed", "decode_peak_kv_bytes_baseline_deployed"])
def test_rows_written_before_the_decoded_bytes_are_refused_in_one_line(runs, capsys, tmp_path, field):
    d = Path(shutil.copytree(runs["streaming"], tmp_path / "s"))
    rows = rows_of(d)
    kept = [{k: v for k, v in r.items() if k != field} for r in rows]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    code, out, err = judge(capsys, runs["gate"], d)
    assert code == 2 and len(err.strip().splitlines()) == 1, (out, err)
    assert "written before evalkit recorded the bytes of the cache each answer was decoded from" in out, out
    assert "rerun it into a new folder" in out, out


def test_a_baseline_decoded_peak_that_is_not_the_baseline_rows_is_refused(runs, capsys, tmp_path):
    d = Path(shutil.copytree(runs["streaming"], tmp_path / "s"))
    rows = rows_of(d)
    for r in rows:
        r["decode_peak_kv_bytes_baseline_deployed"] = r["decode_peak_kv_bytes_baseline_deployed"] * 4
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = judge(capsys, runs["gate"], d)
    assert code == 2 and "decode_peak_kv_bytes_baseline_deployed=" in out, out
    assert "the baseline row's decode_peak_kv_bytes_deployed" in out, out


# --- the label, derived by hand ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "quant", "chunk", "label"),
    [
        ({"class": "evalkit.policies.snapkv.SnapKV", "name": "snapkv", "budget": 0.25}, None, None, "snapkv@0.25"),
        ({"class": "evalkit.policies.none.FullCache", "name": "snapkv", "budget": 0.25}, None, None,
         "none[snapkv]@0.25"),
        ({"class": "evalkit.policies.h2o.H2O", "name": "h2o", "budget": 1024}, None, 512, "h2o@1024:chunk512"),
        ({"class": "evalkit.policies.none.FullCache", "name": "none", "budget": 1.0},
         {"name": "int4", "bits": 4, "format": "int"}, None, "none@1.0+int4"),
        ({"class": "evalkit.policies.none.FullCache", "name": "none", "budget": 1.0},
         {"name": "int4", "bits": 8, "format": "int"}, None, "none@1.0+int8[int4]"),
        ({"class": "evalkit.policies.chunkkv.ChunkKV", "name": "chunkkv(snapkv)", "budget": 0.5,
          "inner": {"class": "evalkit.policies.snapkv.SnapKV", "name": "snapkv", "budget": 0.5}}, None, None,
         "chunkkv(snapkv)@0.5"),
        ({"class": "my_policies.Oldest", "name": "oldest", "budget": 0.5}, None, None, "oldest@0.5"),
        ({"class": "my_policies.Oldest", "name": "snapkv", "budget": 0.5}, None, None, "Oldest[snapkv]@0.5"),
    ],
)  # fmt: skip
def test_labels_derive_from_the_class_and_settings(policy, quant, chunk, label):
    assert variant_label(policy, quant, chunk) == label
    prefill = {"mode": "chunked", "chunk": chunk} if chunk else {"mode": "oneshot"}
    assert row_label({"policy": policy, "quant": quant, "prefill": prefill}) == label


@pytest.mark.parametrize(
    ("row", "asked"),
    [
        ({"policy": {"class": "evalkit.policies.snapkv.SnapKV", "budget": 0.25}}, True),
        ({"policy": {"class": "evalkit.policies.snapkv.SnapKV", "budget": 1.0}}, False),
        ({"policy": {"class": "evalkit.policies.snapkv.SnapKV", "budget": 4096}, "compression_asked": False}, True),
        ({"policy": {"class": "evalkit.policies.dms.DMS", "budget": 1.0}, "compression_asked": True}, True),
        ({"policy": {"class": "evalkit.policies.none.FullCache", "budget": 0.25}, "compression_asked": True}, False),
        ({"policy": {"class": "evalkit.policies.none.FullCache", "budget": 1.0}, "quant": {"bits": 4}}, True),
        ({"policy": {"name": "baseline"}}, False),
    ],
)
def test_compression_asked_is_derived_from_class_budget_and_storage(row, asked):
    assert compression_asked(row) is asked


@pytest.mark.parametrize("option", sorted(p.stem for p in (ROOT / "conf" / "policy").glob("*.yaml")))
def test_every_policy_option_is_labelled_by_its_own_name(option):
    """Every conf/policy option, as configured, derives its own name (a wrapper, its own over its inner's): no
    shipped policy carries a display name its class does not derive."""
    (variant,) = variants(compose_config("model=tiny-random", f"policy={option}"))
    assert variant.name.split("@")[0].split("(")[0] == option, variant.name
    assert "[" not in variant.name and variant.record()["class"].startswith("evalkit.policies.")


@pytest.mark.parametrize(("newest_pruned", "stored"), [(False, [8, 8]), (True, [8, 7])])
def test_deployed_bytes_count_the_channels_any_token_stores(newest_pruned, stored):
    """ThinK's pruned key channels are not stored; a decoded token stores every channel. The count read off the
    newest token alone (the decode's fast path, where it has every channel) equals the scan of every token (where it
    has not: head 1's channel 7 is zero in every token)."""
    keys = torch.randn(1, 2, 10, 8)
    keys[:, 0, :6, :3] = 0  # head 0: its first 6 tokens pruned to 5 channels; its later tokens store all 8
    if newest_pruned:
        keys[:, 0, -1, :3] = 0
        keys[:, 1, :, 7] = 0
    layer = DynamicLayer()
    layer.update(keys, torch.randn(1, 2, 10, 8))
    assert [(keys[0, h] != 0).any(dim=0).sum().item() for h in range(2)] == stored  # the data are what they say
    assert fp16_layer_bytes(layer) == 2 * 10 * sum(c + 8 for c in stored)  # fp16: 2 bytes, keys' channels + values'
