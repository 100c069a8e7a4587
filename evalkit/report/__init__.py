"""Reports of one or more runs, with no torch: one self-contained HTML page (page, data, html, templates/),
report.md and plots (build), and W&B (wandb_log); `python -m evalkit.report`."""
