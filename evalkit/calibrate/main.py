"""`python -m evalkit.calibrate TOOL ...`: the learned methods' calibration and training tools, one subcommand each.

    python -m evalkit.calibrate --help                  # every tool, one line each
    python -m evalkit.calibrate qfilter --model smollm2-135m --out qfilters/smollm2
    python -m evalkit.calibrate restorekv --help

Each tool writes what its policy's `weights_path` reads (policy=qfilter policy.weights_path=OUT, ...). The command
line is parsed before torch loads: a typo is answered at once. Exit code 0 written, 2 bad input (one line: an unknown
option or model, a model whose layers do not all attend fully), 3 a bug (traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from evalkit.errors import ConfigError
from evalkit.exits import guarded

PROG = "python -m evalkit.calibrate"
DESCRIPTION = "The learned methods' calibration and training tools: each writes what its policy's weights_path reads."

# tool -> (the one line --help lists, what --out names)
TOOLS = {
    "qfilter": ("Q-Filters from the model's own queries (policy=qfilter)", "folder for model.safetensors, config.json"),
    "kvzap": ("KVzap's linear surrogates, a stand-in fit (policy=kvzap)", "folder for model.safetensors, config.json"),
    "fastkvzip": ("Fast KVzip's gates, a stand-in training (policy=fastkvzip)", "the torch file to write the gates to"),
    "lukv": ("LU-KV's budget curve, a stand-in calibration (policy=lukv)", "the .npy file to write"),
    "ea_stats": (
        "Expected Attention's query statistics (policy=expected_attention_stats)",
        "folder for model.safetensors, config.json",
    ),
    "restorekv": (
        "RestoreKV's restore tokens and LoRA adapter, a toy-scale distillation (policy=restorekv)",
        "the folder to write (the published layout)",
    ),
}


class _Wide(argparse.HelpFormatter):
    """Help on lines of 120 characters, each tool's line beside its name (argparse leaves the subcommands' indent out
    of the column it computes, and would put `fastkvzip`'s line below it)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=16, width=120)

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        self._action_max_length = max(self._action_max_length, 14)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit 2 (ConfigError through evalkit.exits.guarded)."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def _prompts(sub: argparse.ArgumentParser) -> None:
    """The calibration prompts' options: evalkit's needle prompts over the prose haystack."""
    sub.add_argument("--lengths", type=int, nargs="+", default=[1024], help="context lengths of the prompts, tokens")
    sub.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.9], help="needle depths of the prompts")


def _restorekv(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--steps", type=int, default=200, help="training steps (0: the seeded, untrained start)")
    sub.add_argument("--budget", type=float, default=0.25, help="the kept share of the context while training")
    sub.add_argument("--tokens", type=int, default=8, help="restore tokens (the published adapters: 8)")
    sub.add_argument("--rank", type=int, default=4, help="the adapter's LoRA rank")
    sub.add_argument("--length", type=int, default=512, help="context tokens of a training sample")
    sub.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    sub.add_argument("--seed", type=int, default=0, help="the seeded start's seed")
    sub.add_argument("--held-out", type=int, default=4, help="samples the loss is reported on")


def parser() -> Parser:
    ap = Parser(prog=PROG, description=DESCRIPTION, formatter_class=_Wide)
    tools = ap.add_subparsers(dest="tool", required=True, metavar="TOOL", parser_class=Parser)
    for name, (line, out) in TOOLS.items():
        sub = tools.add_parser(name, help=line, description=line, formatter_class=_Wide)
        sub.add_argument("--model", default="smollm2-135m", help="a conf/model name (default: smollm2-135m)")
        sub.add_argument("--out", required=True, help=out)
        if name == "restorekv":
            _restorekv(sub)
            continue
        _prompts(sub)
        if name == "fastkvzip":
            sub.add_argument("--steps", type=int, default=300, help="Adam steps per layer's gate (0: seeded start)")
        if name == "ea_stats":
            sub.add_argument("--n-sink", type=int, default=4, help="leading tokens left out of the statistics")
    return ap


def check(args: argparse.Namespace) -> None:
    """Values argparse's types do not range: a ConfigError naming the option."""
    counts = {"--lengths": min(getattr(args, "lengths", [1])), "--steps": getattr(args, "steps", 0) + 1}
    counts |= {"--tokens": getattr(args, "tokens", 1), "--rank": getattr(args, "rank", 1)}
    counts |= {"--length": getattr(args, "length", 1), "--held-out": getattr(args, "held_out", 1)}
    for option, value in counts.items():
        if value < 1:
            raise ConfigError(f"{option}: give a whole number of at least {1 if option != '--steps' else 0}")
    if not all(0 <= d <= 1 for d in getattr(args, "depths", [0.5])):
        raise ConfigError(f"--depths {args.depths}: give depths in [0, 1]")
    if not 0 < getattr(args, "budget", 0.5) < 1:
        raise ConfigError(f"--budget {args.budget}: give the kept share of the context, in (0, 1)")
    if getattr(args, "n_sink", 0) < 0:
        raise ConfigError(f"--n-sink {args.n_sink}: give a whole number of at least 0")


def run(args: argparse.Namespace) -> None:
    """The tool's module, imported here so that --help and a typo are answered before torch loads."""
    from evalkit.calibrate import ea_stats, fastkvzip, kvzap, lukv, qfilter, restorekv

    tools = {"qfilter": qfilter, "kvzap": kvzap, "fastkvzip": fastkvzip, "lukv": lukv, "ea_stats": ea_stats}
    tools["restorekv"] = restorekv
    tools[args.tool].main(args)


def main(argv: Sequence[str] | None = None) -> int:
    def start() -> None:
        args = parser().parse_args(argv)
        check(args)
        run(args)

    return guarded(start)
