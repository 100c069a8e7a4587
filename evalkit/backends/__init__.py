"""Backends: the engine that produces a run's paired rows.

`backend=hf` is evalkit's own engine (evalkit.engine, every policy and storage). `backend=llamacpp` runs llama.cpp
in-process on the model's GGUF file, its KV cache types as variants; `backend=openai` sends the rendered prompt to
one OpenAI-compatible server per variant (vLLM, SGLang, llama.cpp's server). The run loop (evalkit.run) builds the
samples and prompts, hands each backend the `Job`s still to do (evalkit.records), scores what comes back with the
task, and writes the rows (evalkit.run.loop, through `Driven`): tasks, records, resume, the gate and the reports do
not know which engine ran. A row says it (`backend`, `engine_version`), and names in `not_observed` each field the
engine cannot observe (left null, never guessed).

No torch here: llama.cpp and HTTP need none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Any, Protocol

from evalkit.errors import ConfigError
from evalkit.modelspec import ModelSpec
from evalkit.records import BASELINE, Job, Result

# evalkit's protocols say which tokens its engine compresses (the context, or the whole prompt); an engine's cache
# type holds every token, prompt and answer alike
PROTOCOL = "engine: every token in the engine's cache type"


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a backend reads of the run besides its own settings (conf/backend): the model, the variants as
    `variants=[...]` lists them (each engine reads its own names: llama.cpp's cache types), the storage `quant=`
    asks for (evalkit's own, refused elsewhere), and the seed."""

    model: ModelSpec
    variants: tuple[str, ...] = ()
    quant: str = "none"
    seed: int = 0


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

    def run(self, jobs: list[Job]) -> Generator[tuple[Job, list[Result]]]:
        """Each job's results, the baseline's first, as they finish."""

    def close(self) -> None:
        """Free the engine or the connections."""


class Driven:
    """A backend as the run's sample loop drives an engine (evalkit.run.loop.Engine): its spec bound, its rows'
    protocol the engine's cache type, and no budget clipped (its variants are cache types, which hold every token)."""

    protocol = PROTOCOL
    interruptible = True

    def __init__(self, backend: Backend, spec: BackendSpec):
        self.backend, self.spec = backend, spec

    def variant_names(self) -> list[str]:
        return self.backend.variant_names()

    def open(self, jobs: list[Job]) -> dict[str, Any]:
        return self.backend.open(self.spec, jobs)

    def run(self, jobs: list[Job]) -> Generator[tuple[Job, list[Result]]]:
        answers = self.backend.run(jobs)
        try:
            for job, results in answers:
                yield job, [dataclasses.replace(r, fields={**r.fields, "budget_clipped": _clipped(r)}) for r in results]
        finally:
            answers.close()  # a stopped loop stops the backend's requests in flight

    def close(self) -> None:
        self.backend.close()


def _clipped(result: Result) -> bool | None:
    """A cache type holds every token: no variant's budget is clipped; None for the baseline, as evalkit's engine."""
    return None if result.variant == BASELINE else False


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
