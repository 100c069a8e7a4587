"""Prefill once, compress many: a list of variants runs on the same samples from one prefill per sample."""

from __future__ import annotations

from collections import Counter, defaultdict

from evalkit.engine import engine, models
from evalkit.records import read_rows
from tests.conftest import compose_config

VARIANTS = ["snapkv@0.25", "snapkv@0.5", "h2o@0.5", "pyramidkv@0.25", "random@0.25", "knorm@64", "streaming_llm@32"]


def test_variants_run_on_the_same_samples_with_one_prefill_each(tmp_path, monkeypatch, capsys):
    """Counted, not inferred: every forward of the model is recorded with the tokens its cache already held and the
    tokens it was given, and every call of evalkit.engine.engine.prefill is counted. A forward from an empty cache is a
    prefill of the context: there is exactly one per sample, over exactly that sample's context, whatever the number
    of variants; every other forward continues a cache that already holds the context (the question, then one token
    per decode step). Were each variant to prefill on its own, there would be 1 + 7 context forwards per sample."""
    from evalkit.cli.job import job_spec, run

    forwards: list[tuple[int, int, int]] = []  # (tokens already cached, tokens given, rows) for every forward
    prefills: list[int] = []  # context length of every call of engine.prefill

    load = models.load

    def load_and_count(*args, **kwargs):
        loaded = load(*args, **kwargs)

        def count(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            rows, given = kwargs["input_ids"].shape
            forwards.append((cache.get_seq_length(), given, rows))

        loaded.model.register_forward_pre_hook(count, with_kwargs=True)
        return loaded

    prefill = engine.prefill

    def prefill_and_count(model, ids, *args, **kwargs):
        prefills.append(ids.shape[-1])
        return prefill(model, ids, *args, **kwargs)

    monkeypatch.setattr(models, "load", load_and_count)
    monkeypatch.setattr(engine, "prefill", prefill_and_count)
    cfg = compose_config(
        "model=tiny-random",
        f"variants=[{','.join(VARIANTS)}]",
        "task.context_lengths=[256]",
        "task.depths=[0.0,0.5,1.0]",
    )
    run(*job_spec(cfg, tmp_path))

    rows = read_rows(tmp_path / "samples.jsonl")
    by_sample = defaultdict(dict)
    for r in rows:
        by_sample[r["sample_id"]][r["variant"]] = r
    assert len(by_sample) == 3
    contexts = [next(iter(s.values()))["context_tokens"] for s in by_sample.values()]
    # one prefill per sample, over exactly that sample's context
    assert sorted(prefills) == sorted(contexts)
    from_empty = [given for held, given, rows in forwards if held == 0 for _ in range(rows)]
    assert Counter(from_empty) == Counter(contexts), forwards
    # every other forward continues a prefilled context: the question of the baseline and of each variant (one
    # each per sample; decoded together, one row each, evalkit.engine.decode), then decode steps of one token
    rest = [(held, given, rows) for held, given, rows in forwards if held > 0]
    assert all(held >= min(contexts) for held, _, _ in rest)
    questions = sum(rows for _, given, rows in rest if given > 1)
    # a variant that kept the same tokens as another reuses its decode (evalkit.engine.outcome) and feeds nothing
    reused = [r for r in rows if r["decoded_like"] is not None]
    assert questions == 3 * (1 + len(VARIANTS)) - len(reused)
    for r in reused:
        like = by_sample[r["sample_id"]][r["decoded_like"]]
        assert r["prediction"] == like["prediction"] and r["tokens_held_per_layer"] == like["tokens_held_per_layer"]

    for sample_rows in by_sample.values():
        assert set(sample_rows) == {"baseline", *VARIANTS}
        base = sample_rows["baseline"]
        for name in VARIANTS:
            r = sample_rows[name]
            assert r["baseline_score"] == base["score"] and r["kv_bytes_baseline"] == base["kv_bytes"]
            assert r["kv_bytes"] < base["kv_bytes"]
        held = sample_rows["knorm@64"]["tokens_held_per_layer"]
        assert held == [64] * 3  # an absolute budget of 64 tokens in each of the tiny Llama's 3 layers
    out = capsys.readouterr().out
    for name in VARIANTS:
        assert name in out
