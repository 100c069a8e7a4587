"""The verdict, with no torch: records read, merged and cross-checked by the leaves (evalkit.records: reading,
merged, evidence), judged (stats, decide and the modules they use; judge) and written (outputs: verdict.json and
report.md; junit: JUnit XML; pipeline: CI's outputs); `python -m evalkit.gate` (command). W&B logs the judged runs
afterwards, from verdict.json (evalkit.report.wandb_log)."""
