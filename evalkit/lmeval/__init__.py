"""lm-eval integration: the `evalkit` model for lm-evaluation-harness, with any policy and quantization.

Every request is answered from one prefill by the full cache (the baseline) and by each variant's compressed one
(prefill once, compress many). lm-eval scores the first variant's answers; the baseline's and the other variants'
are kept and replayed through lm-eval (`EvalkitLM.baseline()`, `EvalkitLM.replay(name)`), so all are scored by
lm-eval's own metrics on the same documents.

Every request type runs as the engine runs a sample (`evalkit.engine.engine.run_sample`): the context is prefilled and
compressed (in one shot, or in chunks for `:chunkN` variants), then the continuation is fed one token at a time
(`teacher_forced`, or `greedy` for generate_until), and a policy with `decode=true` evicts back to its budget after
every forward. One compressed context serves every choice of a multiple-choice item (each choice runs on its own
copy). The KV bytes recorded per document are the engine's: held after compression, at the end, and the peak over
prefill (the full cache exists during a one-shot prefill), compression and every step before its eviction.

    python -m evalkit task=lm_eval 'task.tasks=[evalkit_recall]' policy=snapkv     # through evalkit
    python -m evalkit.lmeval --model evalkit --model_args model=tiny-random,variant=snapkv@0.5 \\
        --tasks evalkit_recall                                                      # lm-eval's own command line

Both routes write the same paired records through evalkit.run.loop (samples.jsonl: a baseline and a variant row per
document, with flips; summary.json; run.json), under the folder's lock, with resume and Ctrl-C. Each row is scored
by one per-document metric chosen before any document runs (choose_metrics: `task.metric`, or a default per task,
or a refusal); for lm-eval's RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv:2404.06654) that is the score at the
document's own length, never the -1 lm-eval logs under the lengths a document was not generated at.
"""
