"""What the calibration scripts share (benchmarks/qfilter_calibrate.py, ea_stats_calibrate.py, lukv_curve.py): their
command line's common options, the model they load and the prompts they calibrate on."""

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
