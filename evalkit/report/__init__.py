"""Reports of one or more runs, with no torch, reading records and the gate's verdict.json, never judging: one
self-contained HTML page (page, data, lost, grid; evalkit.html and evalkit/templates render it), report.md and plots
(build), and W&B (wandb_log, its fields in wandb_fields); `python -m evalkit.report`."""
