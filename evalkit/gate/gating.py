"""The validation gate run on folders: gate() reads the runs, judges them, records its look and writes verdict.json,
report.md and, where asked, JUnit and a step summary, all under the runs' locks. Its command line is evalkit.cli.gate;
the run and a sweep call gate() after their last row, and log to W&B after it (evalkit.report.wandb_log reads the
verdict.json it wrote)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from evalkit.errors import CannotJudge, ConfigError
from evalkit.gate.judge import Verdict, judge
from evalkit.gate.outputs import print_verdict, verdict_doc, write_outputs
from evalkit.gate.pipeline import write_ci
from evalkit.lock import RunLock
from evalkit.records import looks
from evalkit.records.reading import read_runs, run_folders
from evalkit.thresholds import Thresholds

WAIT = 60.0  # seconds a gate waits for another process's lock on a run folder (another gate's look)


def gate(
    run_dirs: list[Path],
    thresholds: Thresholds,
    out_dir: Path | None = None,
    junit: Path | None = None,
    summary: Path | None = None,
) -> Verdict:
    """Judge the runs and write verdict.json and report.md into `out_dir` (default: the first run folder); return a
    PASS or FAIL verdict for the caller to print. INCONCLUSIVE, or records that cannot be judged: the outputs are
    written (where the folder is writable), the reasons printed (print_verdict), then CannotJudge is raised (exit
    code 2) with the samples that would settle it, or what is wrong with the records. The runs are read, judged
    and their look recorded under their folders' locks (evalkit.lock): gates run at once take turns. `junit`,
    `summary`: where the verdict goes for a CI system too (evalkit.gate.pipeline), whatever it is."""
    folders = run_folders(run_dirs)
    with ExitStack() as held:
        for folder in sorted(set(folders)):  # one order for every gate: two never wait on each other
            try:
                held.enter_context(RunLock(folder, wait=WAIT))
            except OSError:  # a read-only folder: judged, its look said not recorded (looks.append)
                pass
        verdict = _judged(run_dirs, folders, thresholds)
        return _finish(verdict, run_dirs, thresholds, out_dir, junit, summary)


def _judged(run_dirs: list[Path], folders: list[Path], thresholds: Thresholds) -> Verdict:
    """The verdict on the runs, its look appended to every folder's looks.jsonl (the caller holds the locks)."""
    records = read_runs(run_dirs)
    recorded = looks.read(folders, records.infos)
    verdict = judge(records.rows, records.infos, thresholds, records.problems, recorded, records.partial)
    verdict.runs = [str(d) for d in run_dirs]
    if verdict.status != "CANNOT JUDGE":
        # the look records the verdict's reasons beside its status: a report shows verdict.json only where they agree
        verdict.look["reasons"] = list(verdict.reasons)
        verdict.not_judged += looks.append(folders, verdict.look, verdict.history, recorded)
    return verdict


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
