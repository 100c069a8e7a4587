"""Prefill once, compress many: a list of variants runs on the same samples from one prefill per sample."""

from __future__ import annotations

from collections import defaultdict

from evalkit.records import read_rows
from tests.conftest import run_cli

VARIANTS = ["snapkv@0.25", "snapkv@0.5", "h2o@0.5", "pyramidkv@0.25", "random@0.25", "knorm@64", "streaming_llm@32"]


def test_variants_run_on_the_same_samples_with_one_prefill_each(tmp_path):
    result = run_cli(
        "model=tiny-random",
        f"variants=[{','.join(VARIANTS)}]",
        "task.context_lengths=[256]",
        "task.depths=[0.0,0.5,1.0]",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    rows = read_rows(tmp_path / "samples.jsonl")
    by_sample = defaultdict(dict)
    for r in rows:
        by_sample[r["sample_id"]][r["variant"]] = r
    assert len(by_sample) == 3
    for sample_rows in by_sample.values():
        assert set(sample_rows) == {"baseline", *VARIANTS}
        # one prefill served every variant of the sample: they all report the same prefill
        assert len({r["seconds"]["prefill"] for r in sample_rows.values()}) == 1
        base = sample_rows["baseline"]
        for name in VARIANTS:
            r = sample_rows[name]
            assert r["baseline_score"] == base["score"] and r["kv_bytes_baseline"] == base["kv_bytes"]
            assert r["kv_bytes"] < base["kv_bytes"]
        held = sample_rows["knorm@64"]["tokens_held_per_layer"]
        assert held == [64] * len(held)
    for name in VARIANTS:
        assert name in result.stdout
