"""evalkit's offline lm-eval tasks and lm-eval's task index with them: what task=lm_eval checks its task names against
before any model loads (no torch here; lm-eval itself is imported when the index is first built)."""

from __future__ import annotations

import functools
import json
from importlib.resources import files
from pathlib import Path

from platformdirs import user_cache_dir

TASKS = ("evalkit_recall",)


def task_dir() -> Path:
    """A folder holding the bundled offline tasks' YAML, pointing at the bundled JSONL by absolute path."""
    out = Path(user_cache_dir("evalkit")) / "lmeval_tasks"
    out.mkdir(parents=True, exist_ok=True)
    src = files("evalkit.lmeval.bundled")
    for name in TASKS:
        data = Path(str(src / f"{name}.jsonl"))
        text = (src / f"{name}.yaml").read_text().replace("__DATA__", json.dumps(str(data)))
        (out / f"{name}.yaml").write_text(text)
    return out


@functools.cache
def task_manager():
    """lm-eval's task index with evalkit's offline tasks included (built once: it scans every task YAML)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir()))
