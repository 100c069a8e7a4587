"""What the calibration tools share (evalkit.calibrate: qfilter, ea_stats, lukv, kvzap, fastkvzip, restorekv): the
model they load, the prompts they calibrate on, and the KVzip scores with the hidden states that the learned scorers
are fitted from."""

from __future__ import annotations

import argparse
from importlib.resources import files

import torch
from omegaconf import OmegaConf

from evalkit.cli.spec import model_spec
from evalkit.config.choices import did_you_mean, options
from evalkit.engine import models
from evalkit.engine.engine import prefill, reconstruction
from evalkit.errors import ConfigError
from evalkit.policies.kvzap import HiddenStates
from evalkit.policies.kvzip import KVzip
from evalkit.policies.kvzip_pass import Reconstruction
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import build_prompt


def load_model(name: str) -> models.LoadedModel:
    """conf/model/NAME.yaml's model on the CPU, or a ConfigError listing the model names there."""
    valid = options("model", ())
    if name not in valid:
        hint = did_you_mean(name, valid)
        raise ConfigError(f"--model {name!r}: unknown model{hint}; valid names: {', '.join(valid)}")
    return models.load(model_spec(OmegaConf.load(files("evalkit.conf") / "model" / f"{name}.yaml")), "cpu")


def load(args: argparse.Namespace) -> tuple[models.LoadedModel, list[torch.Tensor]]:
    """The model of --model on the CPU, and the calibration prompts of --lengths and --depths."""
    loaded = load_model(args.model)
    return loaded, contexts(loaded.tokenizer, args.lengths, args.depths)


def every_layer(found: int, model, method: str) -> None:
    """A ConfigError unless every layer of `model` attends fully (`found` of them did): `method` needs each."""
    n = model.config.get_text_config().num_hidden_layers
    if found != n:
        raise ConfigError(f"{found} of {n} layers attend fully: {method} needs every layer")


def contexts(tokenizer, lengths: list[int], depths: list[float]) -> list[torch.Tensor]:
    """The calibration prompts: the context ids (1, n) of evalkit's needle prompts over the prose haystack."""
    task = NeedleTask(context_lengths=lengths, depths=depths, haystack="prose", samples_per_cell=1)
    out = []
    for sample in task.samples(tokenizer):
        prompt = build_prompt(tokenizer, sample)
        out.append(prompt.ids[:, : prompt.n_context])
    return out


class Recorded(KVzip):
    """Not a policy to run: KVzip's observation (or KVzip+'s) and the hidden states, recorded for a fit."""

    def needs(self):
        return (Reconstruction(self.n_sink, self.chunk_size, self.plus), HiddenStates())


def scores_and_hidden(
    model, prompts: list[torch.Tensor], sinks: int, chunk: int, plus: bool
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, over all prompts end to end: the hidden states entering its attention (1, N, hidden) and evalkit's
    KVzip (or KVzip+) scores (1, Hkv, N) of every context token after the first `sinks` (which KVzip keeps whatever
    they score): the reconstruction pass over the prompt's raw ids (no repeat instruction), `chunk` tokens a pass."""
    pol = Recorded(budget=1.0, n_sink=sinks, chunk_size=chunk, plus=plus)
    xs: dict[int, list] = {}
    ys: dict[int, list] = {}
    for ids in prompts:
        full, obs = prefill(model, ids.to(model.device), [pol])
        reconstruction(model, full, ids, None, [pol], obs)
        for layer, values in obs.items():
            xs.setdefault(layer, []).append(values[HiddenStates()][:, sinks:])
            ys.setdefault(layer, []).append(values[Reconstruction(sinks, chunk, plus)][:, :, sinks:])
    return {layer: (torch.cat(xs[layer], dim=1), torch.cat(ys[layer], dim=2)) for layer in sorted(xs)}
