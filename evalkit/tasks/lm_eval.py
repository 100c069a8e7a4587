"""Any lm-eval task (lm-evaluation-harness), variant and baseline scored by lm-eval's own metrics.

`task=lm_eval task.tasks=[evalkit_recall]`; the bundled `evalkit_recall` runs offline, Hub tasks need the Hub.
See evalkit.lmeval for how requests are answered.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass, field

from evalkit.errors import ConfigError
from evalkit.tasks import Task


@dataclass(kw_only=True)
class LmEvalTask(Task):
    name: str = "lm_eval"
    tasks: list[str] = field(default_factory=lambda: ["evalkit_recall"])
    limit: int | None = None  # documents per task (None: all)
    num_fewshot: int | None = None
    external: bool = True  # evaluated by lm-eval (evalkit.lmeval.evaluate), not sample by sample

    def lengths(self) -> list[int]:
        return []

    def validate(self) -> None:
        super().validate()
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"task.limit={self.limit}: give a number of documents >= 1, or null for all of them")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"task.num_fewshot={self.num_fewshot} is negative; give 0 or more, or null")
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError("task=lm_eval needs lm-eval: pip install 'lm-eval>=0.4.9,<0.5'")
        if not self.tasks:
            raise ConfigError("task.tasks is empty; name at least one lm-eval task, e.g. 'task.tasks=[evalkit_recall]'")
        from evalkit.lmeval import task_manager

        known = set(task_manager().all_tasks)
        for name in self.tasks:
            if name not in known:
                near = difflib.get_close_matches(name, sorted(known), n=3)
                hint = f"; did you mean {', '.join(near)}?" if near else ""
                raise ConfigError(f"task.tasks: lm-eval knows no task {name!r}{hint}")
