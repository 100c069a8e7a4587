"""What the calibration scripts share (benchmarks/qfilter_calibrate.py, ea_stats_calibrate.py, lukv_curve.py,
kvzap_calibrate.py, fastkvzip_calibrate.py): their command line's common options, the model they load, the prompts they
calibrate on, and the KVzip scores with the hidden states that the learned scorers are fitted from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalkit.cli.spec import model_spec  # noqa: E402
from evalkit.engine import models  # noqa: E402
from evalkit.engine.engine import prefill, reconstruction  # noqa: E402
from evalkit.policies.kvzap import HiddenStates  # noqa: E402
from evalkit.policies.kvzip import KVzip  # noqa: E402
from evalkit.policies.kvzip_pass import Reconstruction  # noqa: E402
from evalkit.tasks.needle import NeedleTask  # noqa: E402
from evalkit.tasks.prompt import build_prompt  # noqa: E402


def parser(doc: str, out: str) -> argparse.ArgumentParser:
    """--model, --out (`out`: what it names), --lengths and --depths of the calibration prompts."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a conf/model name")
    ap.add_argument("--out", required=True, help=out)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.9])
    return ap


def load(args: argparse.Namespace) -> tuple[models.LoadedModel, list[torch.Tensor]]:
    """The model of --model on the CPU, and the calibration prompts of --lengths and --depths."""
    loaded = models.load(model_spec(OmegaConf.load(ROOT / "conf" / "model" / f"{args.model}.yaml")), "cpu")
    return loaded, contexts(loaded.tokenizer, args.lengths, args.depths)


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
