"""The prompts a policy learns from while it prepares (policies.Probes): built here, with the run's tokenizer and
evalkit's own needle task, so that policies never build prompts or tasks themselves."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from evalkit.policies import Probe
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt

SEED = 1234  # the calibration's needles: the same for every run, whatever the run's seed


@dataclass
class NeedleProbes:
    """Synthetic needles (evalkit.tasks.needle, noise haystack) in the model's own chat template."""

    tokenizer: PreTrainedTokenizerBase

    def needles(self, context: int, depths: list[float]) -> list[Probe]:
        task = NeedleTask(context_lengths=[context], depths=depths, seed=SEED)
        prompts = [build_prompt(self.tokenizer, sample) for sample in task.samples(self.tokenizer)]
        return [Probe(p.ids, p.evidence, p.ids.shape[1] - p.n_context) for p in prompts]
