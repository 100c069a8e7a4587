"""The validation gate: runs judged against thresholds -> PASS, FAIL, INCONCLUSIVE or CANNOT JUDGE.

The gate's command line (the gate itself: evalkit.gate.gating.gate):

    python -m evalkit.gate results/RUN [results/RUN2 ...] [--gate conf/gate/default.yaml] [--out DIR]
    python -m evalkit.gate --plan [--gate default] [--variants 3] [--cells 10]   # the samples a PASS needs
    python -m evalkit gate=default policy=snapkv task=needle          # run, then gate

Exit code 0 PASS, 1 FAIL, 2 INCONCLUSIVE or cannot judge (or a usage error). PASS: every threshold is shown to hold
at the gate's one-sided confidence (evalkit.gate.decide). FAIL: a threshold is shown broken, compression was asked but
not achieved, or runs whose model weights, protocol or library versions differ. INCONCLUSIVE: neither, with the
samples that would settle it. CANNOT JUDGE, never a PASS: records that cannot support a verdict (torn, corrupt or
repeated rows, several runs in one file, no policy rows, a variant not run on the baseline's samples, a missing
run.json, a baseline too weak for the task, a score its prediction does not earn, a field the gate judges deleted, two
folders of one experiment that disagree). An unfinished run never PASSes unless gate.allow_partial. Writes
verdict.json and report.md either way."""

from __future__ import annotations

import argparse
from pathlib import Path

from evalkit.config import gatefile
from evalkit.errors import EXIT_FAIL, EXIT_OK, CannotJudge, ConfigError
from evalkit.exits import guarded
from evalkit.gate.decide import floor
from evalkit.gate.gating import gate
from evalkit.gate.outputs import print_verdict
from evalkit.gate.power import samples_advice
from evalkit.thresholds import Thresholds, thresholds
from evalkit.tracking import wandb_package


def load_thresholds(name_or_path: str) -> Thresholds:
    """conf/gate/NAME.yaml or a YAML file of thresholds, typed and ranged; a ConfigError naming what is wrong."""
    return thresholds(gatefile.read(name_or_path), repr(name_or_path))


def _plan(args) -> list[str]:
    """--plan: the samples a PASS needs, for the thresholds and the rates given."""
    if args.variants < 1 or args.cells < 1 or args.questions_per_context < 1:
        raise ConfigError("--variants, --cells and --questions-per-context count things: give whole numbers >= 1")
    if not 0 <= args.icc <= 1:
        raise ConfigError(f"--icc {args.icc}: give a correlation in [0, 1]")
    rates = None
    if args.loss is not None:
        if not (0 <= args.loss <= 1 and 0 <= args.gain <= 1 and args.loss + args.gain <= 1):
            raise ConfigError(f"--loss {args.loss} --gain {args.gain}: give rates in [0, 1] that sum to at most 1")
        rates = [(args.loss, args.gain)]
    t = load_thresholds(args.gate)
    return samples_advice(t, floor(t), args.variants, args.cells, rates, args.questions_per_context, args.icc)


def log_wandb(runs: list[Path], judged: Path) -> None:
    """Log every run folder under `runs` to its W&B runs, whole, with the verdict.json the gate wrote into `judged`
    (the same ids: one W&B run per variant, updated, never a second one)."""
    from evalkit.report.wandb_log import log_folders  # plotly and the wandb package: only when --wandb asks

    local = log_folders(runs, judged)
    print(f"evalkit: W&B runs written to {', '.join(map(str, local))}" if local else "evalkit: no W&B run written")


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        ap = argparse.ArgumentParser(prog="python -m evalkit.gate", description=__doc__.splitlines()[0])
        ap.add_argument("runs", nargs="*", type=Path, help="evalkit run folders (or folders holding several)")
        ap.add_argument("--gate", default="default", help="a conf/gate name or a YAML file of thresholds")
        ap.add_argument("--out", type=Path, help="where verdict.json and report.md go (default: the first run)")
        ap.add_argument("--junit", type=Path, help="also write JUnit XML: a case per variant and check")
        ap.add_argument("--summary", type=Path, help="also append a Markdown summary (e.g. $GITHUB_STEP_SUMMARY)")
        ap.add_argument("--wandb", action="store_true", help="then log the runs, verdict included, to their W&B runs")
        ap.add_argument("--plan", action="store_true", help="print the samples a PASS needs, and judge nothing")
        ap.add_argument("--variants", type=int, default=1, help="with --plan: variants judged together")
        ap.add_argument("--cells", type=int, default=1, help="with --plan: cells per variant")
        ap.add_argument("--loss", type=float, help="with --plan: the policy's loss rate (right to wrong), e.g. 0.01")
        ap.add_argument("--gain", type=float, default=0.0, help="with --plan: its gain rate (wrong to right)")
        ap.add_argument("--questions-per-context", type=int, default=1, help="with --plan: questions on one context")
        ap.add_argument("--icc", type=float, default=0.5, help="with --plan: correlation of a context's questions")
        args = ap.parse_args(argv)
        if args.plan:
            print("\n".join(_plan(args)))
            return EXIT_OK
        if not args.runs:
            raise ConfigError("give one or more run folders to judge (or --plan to size a run)")
        if args.wandb:
            wandb_package()  # a missing package is said before anything is judged or written
        try:
            verdict = gate(args.runs, load_thresholds(args.gate), args.out, args.junit, args.summary)
        except CannotJudge:  # INCONCLUSIVE or CANNOT JUDGE: printed, verdict.json written; W&B shows it too
            if args.wandb:
                log_wandb(args.runs, args.out or args.runs[0])
            raise
        print_verdict(verdict)
        if args.wandb:
            log_wandb(args.runs, args.out or args.runs[0])
        return EXIT_OK if verdict.passed else EXIT_FAIL

    return guarded(run)
