"""Backends: the engine that produces a run's paired rows.

`backend=hf` is evalkit's own engine (evalkit.run.engine, every policy and storage). `backend=llamacpp` runs llama.cpp
in-process on the model's GGUF file, its KV cache types as variants; `backend=openai` sends the rendered prompt to
one OpenAI-compatible server per variant (vLLM, SGLang, llama.cpp's server). The run loop (evalkit.run) builds the
samples and prompts, hands each backend the `Job`s still to do, scores what comes back with the task, and writes the
rows: tasks, records, resume, the gate and the reports do not know which engine ran. A row says it (`backend`,
`engine_version`), and names in `not_observed` each field the engine cannot observe (left null, never guessed).

No torch here: llama.cpp and HTTP need none.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from evalkit.errors import ConfigError
from evalkit.modelspec import ModelSpec

NAMES = ("hf", "llamacpp", "openai")


@dataclass(frozen=True)
class BackendSpec:
    """What a backend reads of the run besides its own settings (conf/backend): the model, the variants as
    `variants=[...]` lists them (each engine reads its own names: llama.cpp's cache types), the storage `quant=`
    asks for (evalkit's own, refused elsewhere), and the seed."""

    model: ModelSpec
    variants: tuple[str, ...] = ()
    quant: str = "none"
    seed: int = 0


@dataclass
class Job:
    """One sample for a backend to run: the prompt as evalkit tokenized it and as text, the most tokens to generate,
    and the variants whose rows are still missing (the baseline always runs: every variant is paired with it)."""

    sample_id: str
    ids: list[int]  # the whole prompt (evalkit.tasks.prompt.build_prompt)
    text: str  # the same prompt rendered as text (evalkit.tasks.prompt.prompt_text): what a server is sent
    max_new_tokens: int
    variants: list[str]


@dataclass
class Result:
    """What the engine did on one job for the baseline or one variant: the answer's text and the row fields the
    engine observed (KV bytes, seconds, fidelity); `not_observed` names, with the reason, each field it cannot see."""

    variant: str
    prediction: str
    fields: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """What evalkit.run asks of an engine other than its own."""

    name: str

    def check(self, spec: BackendSpec, task: Any) -> None:
        """ConfigError for what is wrong before anything loads or is contacted: variants, settings, the task."""

    def variant_names(self) -> list[str]:
        """The variants' names, as rows record them (the baseline is `baseline`)."""

    def open(self, spec: BackendSpec, jobs: list[Job]) -> dict[str, Any]:
        """Load the engine or reach the servers, and refuse (ConfigError) what cannot give a fair comparison; return
        what run.json records of the engine (`engine`, `engine_version`, settings) and of the model (`model`)."""

    def run(self, jobs: list[Job]) -> Iterator[tuple[Job, list[Result]]]:
        """Each job's results, the baseline's first, as they finish."""

    def close(self) -> None:
        """Free the engine or the connections."""


def check_generates(backend: str, task: Any) -> None:
    """Backends generate answers: a task that teacher-forces a continuation or that lm-eval drives is refused."""
    if getattr(task, "teacher_forced", False):
        raise ConfigError(
            f"backend={backend} generates answers; task={task.name} scores the logits of a teacher-forced "
            "continuation, which evalkit measures with backend=hf only"
        )
    if getattr(task, "external", False):
        raise ConfigError(f"backend={backend}: task={task.name} is driven by lm-eval, which runs with backend=hf only")


def check_variants_unused(spec: BackendSpec, backend: str) -> None:
    """A run on another engine stores nothing in evalkit's own formats: `quant=...` is refused, not silently
    ignored."""
    if spec.quant != "none":
        raise ConfigError(
            f"quant={spec.quant} is evalkit's own storage (backend=hf); with backend={backend} the engine's KV types "
            "are the variants: drop quant=..."
        )
