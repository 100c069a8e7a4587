"""With a chunked prefill the cache's peak does not grow with the context: on the tiny model at 1k and 4k tokens, the
peak KV held while prefilling stays at the bound (budget + one chunk), where a one-shot prefill's peak is the whole
context's. How time and memory grow to long contexts is for a benchmark to measure, not a test."""

from __future__ import annotations

from evalkit.records import SAMPLES, read_rows
from tests.conftest import run_cli


def test_peak_kv_with_chunked_prefill_stays_at_the_bound_from_1k_to_4k_tokens(tmp_path):
    args = [
        "model=tiny-random",
        "model.max_context=8192",
        "task.context_lengths=[1024,4096]",
        "task.depths=[0.5]",
        "policy=snapkv",
    ]
    args += ["policy.budget=64", "prefill=chunked", "prefill.chunk=128", f"hydra.run.dir={tmp_path}"]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    rows = read_rows(tmp_path / SAMPLES)
    chunked = {r["cell"]["context_length"]: r for r in rows if r["variant"] == "snapkv@64:chunk128"}
    oneshot = {r["cell"]["context_length"]: r for r in rows if r["variant"] == "snapkv@64"}
    assert sorted(chunked) == sorted(oneshot) == [1024, 4096]
    per_token = oneshot[1024]["kv_bytes_baseline"] / oneshot[1024]["context_tokens"]
    for n in (1024, 4096):
        assert chunked[n]["prefill_bound_tokens"] == 64 + 128
        assert chunked[n]["prefill_peak_tokens"] <= 64 + 128
        assert chunked[n]["prefill_peak_kv_bytes"] <= (64 + 128) * per_token
        assert oneshot[n]["prefill_peak_kv_bytes"] == oneshot[n]["context_tokens"] * per_token  # the whole context
    assert chunked[4096]["prefill_peak_kv_bytes"] == chunked[1024]["prefill_peak_kv_bytes"]  # flat in the context
    assert oneshot[4096]["prefill_peak_kv_bytes"] > 3.5 * oneshot[1024]["prefill_peak_kv_bytes"]
