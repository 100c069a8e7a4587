"""A sweep's progress on the launching console: one line per job as it finishes, with its figures, and now and then a
line of the rows written so far, whatever the launcher (the basic one, joblib, submitit's local executor, whose jobs
print only into their log files under .submitit/).

A job has finished when its run folder holds a summary.json written since the sweep began (evalkit.run.loop.finish
writes it after the job's last row); a job that stops early writes none, and the launcher's own error says so.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from evalkit.records import BASELINE, SAMPLES, SUMMARY, loads

POLL_S = 2.0  # how often the sweep folder is looked at
TAIL_S = 60.0  # at most one line of rows written per this many seconds, when rows were added


def finished_line(job: str, summary: dict[str, Any], done: int, total: int | None, seconds: float) -> str:
    """`evalkit: job 1/4 done (12 s): FOLDER: h2o@0.25 0.50 vs baseline 0.67 (lost 1, gained 0, n 6)`."""
    figures = []
    for name, v in summary.items():
        if name == BASELINE or not isinstance(v, dict):
            continue
        figures.append(
            f"{name} {_number(v.get('accuracy'))} vs baseline {_number(v.get('baseline_accuracy'))} "
            f"(lost {v.get('lost', '-')}, gained {v.get('gained', '-')}, n {v.get('n', '-')})"
        )
    count = f"{done}/{total}" if total else str(done)
    return f"evalkit: job {count} done ({seconds:.0f} s): {job}: " + ("; ".join(figures) or "no variant rows")


def _number(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


class Progress:
    """Watches a sweep folder from the launching process, in a thread of its own, until stop()."""

    def __init__(self, sweep: Path, total: int | None, out: TextIO | None = None) -> None:
        self.sweep, self.total, self.out = sweep, total, out or sys.stdout
        self.start_time = time.monotonic()
        self.before = self._summaries()  # summaries of an earlier run of the sweep (resume=true): not this run's
        self.reported: set[Path] = set()
        self.rows, self.last_tail = 0, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="evalkit-sweep-progress", daemon=True)

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching, after a last look (the jobs that finished since the previous one are said too)."""
        self._stop.set()
        self._thread.join()
        self.poll()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def _summaries(self) -> dict[Path, int]:
        out = {}
        for path in self.sweep.rglob(SUMMARY) if self.sweep.is_dir() else ():
            try:
                out[path] = path.stat().st_mtime_ns
            except OSError:  # removed meanwhile
                continue
        return out

    def poll(self) -> None:
        """Say each job that finished since the last look; now and then, the rows written so far."""
        for path, mtime in sorted(self._summaries().items()):
            if path in self.reported or self.before.get(path) == mtime or path.parent == self.sweep:
                continue
            try:
                summary = loads(path.read_text())
            except (OSError, ValueError):  # being written: the next look reads it
                continue
            self.reported.add(path)
            job, elapsed = str(path.parent.relative_to(self.sweep)), time.monotonic() - self.start_time
            summary = summary if isinstance(summary, dict) else {}
            self._say(finished_line(job, summary, len(self.reported), self.total, elapsed))
        self._tail()

    def _tail(self) -> None:
        if time.monotonic() - self.last_tail < TAIL_S:
            return
        rows = 0
        for path in self.sweep.rglob(SAMPLES):
            try:
                rows += path.read_bytes().count(b"\n")
            except OSError:
                continue
        self.last_tail = time.monotonic()
        if rows != self.rows:
            self.rows = rows
            total = f"/{self.total}" if self.total else ""
            self._say(f"evalkit: sweep running: {len(self.reported)}{total} jobs done, {rows} rows written so far")

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)
