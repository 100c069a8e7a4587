"""The validation gate: runs judged against thresholds -> PASS, FAIL, INCONCLUSIVE or CANNOT JUDGE.

gate() reads, judges and records a look under the runs' locks and writes the outputs (the run and a sweep call it
after their last row); main() is its command line:

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
from contextlib import ExitStack
from pathlib import Path

from evalkit.errors import EXIT_FAIL, EXIT_OK, CannotJudge, ConfigError
from evalkit.exits import guarded
from evalkit.gate import looks
from evalkit.gate.decide import floor
from evalkit.gate.judge import Verdict, judge
from evalkit.gate.outputs import print_verdict, verdict_doc, write_outputs
from evalkit.gate.pipeline import write_ci
from evalkit.gate.power import samples_advice
from evalkit.gate.reading import read_runs, run_folders
from evalkit.gate.thresholds import Thresholds, load_thresholds
from evalkit.gate.tracked import log_verdict
from evalkit.lock import RunLock
from evalkit.tracking import wandb_package

WAIT = 60.0  # seconds a gate waits for another process's lock on a run folder (another gate's look)


def gate(
    run_dirs: list[Path],
    thresholds: Thresholds,
    out_dir: Path | None = None,
    junit: Path | None = None,
    summary: Path | None = None,
    wandb: bool = False,
) -> Verdict:
    """Judge the runs and write verdict.json and report.md into `out_dir` (default: the first run folder); return a
    PASS or FAIL verdict for the caller to print. INCONCLUSIVE, or records that cannot be judged: the outputs are
    written (where the folder is writable), the reasons printed (print_verdict), then CannotJudge is raised (exit
    code 2) with the samples that would settle it, or what is wrong with the records. The runs are read, judged
    and their look recorded under their folders' locks (evalkit.lock): gates run at once take turns. `junit`,
    `summary`: where the verdict goes for a CI system too (evalkit.gate.pipeline), whatever it is; `wandb`: and to
    the W&B runs of the runs judged (evalkit.gate.tracked)."""
    folders = run_folders(run_dirs)
    with ExitStack() as held:
        for folder in sorted(set(folders)):  # one order for every gate: two never wait on each other
            try:
                held.enter_context(RunLock(folder, wait=WAIT))
            except OSError:  # a read-only folder: judged, its look said not recorded (looks.append)
                pass
        verdict, infos = _judged(run_dirs, folders, thresholds)
        if wandb:
            logged = log_verdict(infos, verdict_doc(verdict, thresholds))
            print(
                f"evalkit gate: the verdict logged to {len(logged)} W&B run(s)"
                if logged
                else "evalkit gate: no W&B run to log the verdict to (no readable run.json and rows)"
            )
        return _finish(verdict, run_dirs, thresholds, out_dir, junit, summary)


def _judged(run_dirs: list[Path], folders: list[Path], thresholds: Thresholds) -> tuple[Verdict, list[dict]]:
    """The verdict on the runs, its look appended to every folder's looks.jsonl (the caller holds the locks), and
    the runs' run.json as read."""
    records = read_runs(run_dirs)
    recorded = looks.read(folders, records.infos)
    verdict = judge(records.rows, records.infos, thresholds, records.problems, recorded, records.partial)
    verdict.runs = [str(d) for d in run_dirs]
    if verdict.status != "CANNOT JUDGE":
        verdict.not_judged += looks.append(folders, verdict.look, verdict.history)
    return verdict, records.infos


def _finish(
    verdict: Verdict,
    run_dirs: list[Path],
    thresholds: Thresholds,
    out_dir: Path | None,
    junit: Path | None,
    summary: Path | None,
) -> Verdict:
    """Write verdict.json and report.md; return a PASS or FAIL, raise CannotJudge otherwise (see gate)."""
    out = out_dir or run_dirs[0]
    write_ci(verdict_doc(verdict, thresholds), junit, summary)
    if verdict.status in ("PASS", "FAIL"):
        write_outputs(verdict, out, thresholds)
        return verdict
    try:
        write_outputs(verdict, out, thresholds)
    except ConfigError as err:
        verdict.reasons.append(f"(verdict.json and report.md not written: {err})")
    print_verdict(verdict)
    if verdict.status == "INCONCLUSIVE":
        raise CannotJudge(f"the gate is INCONCLUSIVE: {verdict.advice}")
    more = len(verdict.reasons) - 1
    raise CannotJudge(
        f"the gate cannot judge these records: {verdict.reasons[0]}" + (f" (and {more} more, above)" if more else "")
    )


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


def main(argv: list[str] | None = None) -> int:
    def run() -> int:
        ap = argparse.ArgumentParser(prog="python -m evalkit.gate", description=__doc__.splitlines()[0])
        ap.add_argument("runs", nargs="*", type=Path, help="evalkit run folders (or folders holding several)")
        ap.add_argument("--gate", default="default", help="a conf/gate name or a YAML file of thresholds")
        ap.add_argument("--out", type=Path, help="where verdict.json and report.md go (default: the first run)")
        ap.add_argument("--junit", type=Path, help="also write JUnit XML: a case per variant and check")
        ap.add_argument("--summary", type=Path, help="also append a Markdown summary (e.g. $GITHUB_STEP_SUMMARY)")
        ap.add_argument("--wandb", action="store_true", help="also log the verdict to the W&B runs of the runs")
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
        verdict = gate(args.runs, load_thresholds(args.gate), args.out, args.junit, args.summary, args.wandb)
        print_verdict(verdict)
        return EXIT_OK if verdict.passed else EXIT_FAIL

    return guarded(run)


if __name__ == "__main__":
    raise SystemExit(main())
