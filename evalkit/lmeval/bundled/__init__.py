"""Offline tasks for lm-eval shipped with evalkit (JSONL data and YAML task configs)."""
