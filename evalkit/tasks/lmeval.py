"""Any lm-eval task (lm-evaluation-harness), variant and baseline scored by lm-eval's own metrics.

`task=lm_eval task.tasks=[evalkit_recall]`; the bundled `evalkit_recall` runs offline, Hub tasks need the Hub.
lm-eval's synthetic long-context suites take their settings from `task.metadata` (lm-eval's `--metadata`): RULER
(Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?", arXiv:2404.06654)
builds its haystacks at `task.metadata.max_seq_lengths`, sized by `task.metadata.tokenizer` (by default the
evaluated model's own tokenizer). `task.metric` names the per-document metric that the paired records and flips
are scored by (evalkit.lmeval.metrics.choose_metrics: a sound default per task, a refusal when it is ambiguous).
See evalkit.lmeval for how requests are answered.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, ClassVar

from evalkit.errors import ConfigError
from evalkit.tasks import Task
from evalkit.tasks.lmeval_index import known_tasks


@dataclass(kw_only=True)
class LmEvalTask(Task):
    name: str = "lm_eval"
    tasks: list[str] = field(default_factory=lambda: ["evalkit_recall"])
    limit: int | None = None  # documents per task (None: all)
    num_fewshot: int | None = None
    # lm-eval task metadata (its `--metadata`): RULER's max_seq_lengths and tokenizer; null entries are left out
    metadata: dict[str, Any] = field(default_factory=dict)
    # lm-eval's --gen_kwargs for generate_until tasks (e.g. max_gen_toks); null entries are left out
    gen_kwargs: dict[str, Any] = field(default_factory=dict)
    # the per-document metric rows are scored by: one name for every task, or {task: name}; null: the default
    metric: str | dict[str, str] | None = None
    # documents per lm-eval call: rows are written as each call finishes (null: every document in one call)
    documents_per_call: int | None = None
    include: list[str] | None = None  # task folders in place of evalkit's bundled one (lm-eval's --include_path)
    external: ClassVar[bool] = True  # evaluated by lm-eval (evalkit.lmeval.evaluate), not sample by sample

    def lengths(self) -> list[int]:
        return []

    def lm_eval_metadata(self) -> dict[str, Any]:
        """task.metadata without its null entries (the preset declares the keys RULER reads, unset)."""
        return {k: v for k, v in self.metadata.items() if v is not None}

    def include_paths(self) -> list[str] | None:
        return list(self.include) if self.include else None

    def lm_eval_gen_kwargs(self) -> dict[str, Any] | None:
        """task.gen_kwargs without its null entries; None when nothing is set (each task's own generation_kwargs)."""
        return {k: v for k, v in self.gen_kwargs.items() if v is not None} or None

    def validate(self) -> None:
        super().validate()
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"task.limit={self.limit}: give a number of documents >= 1, or null for all of them")
        if self.documents_per_call is not None and self.documents_per_call < 1:
            raise ConfigError(
                f"task.documents_per_call={self.documents_per_call}: give a number of documents >= 1, or null"
            )
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ConfigError(f"task.num_fewshot={self.num_fewshot} is negative; give 0 or more, or null")
        lengths = self.metadata.get("max_seq_lengths")
        if lengths is not None and (
            not isinstance(lengths, list)
            or not lengths
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths)
        ):
            raise ConfigError(
                f"task.metadata.max_seq_lengths={lengths!r}: give a list of token counts, e.g. "
                "'task.metadata.max_seq_lengths=[1024]'"
            )
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError("task=lm_eval needs lm-eval: pip install 'lm-eval>=0.4.9,<0.5'")
        if not self.tasks:
            raise ConfigError("task.tasks is empty; name at least one lm-eval task, e.g. 'task.tasks=[evalkit_recall]'")
        known = known_tasks()
        for name in self.tasks:
            if name not in known:
                near = difflib.get_close_matches(name, sorted(known), n=3)
                hint = f"; did you mean {', '.join(near)}?" if near else ""
                raise ConfigError(f"task.tasks: lm-eval knows no task {name!r}{hint}")
