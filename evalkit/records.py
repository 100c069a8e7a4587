"""Append-only results: `samples.jsonl` (one row per sample x variant, flushed as each finishes) and `run.json`.

A killed run loses at most the row in flight: rows are written whole, flushed and fsynced; a torn last line
left by a kill is cut off when the run resumes. A write that fails (a full disk, a folder made read-only) is undone
to the last whole row and reported as a ConfigError that names the file and the fix.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from evalkit.errors import ConfigError

SAMPLES = "samples.jsonl"
RUN = "run.json"
SUMMARY = "summary.json"


def read_rows(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Rows of a samples.jsonl. A torn final line (a killed write) is dropped, and cut from the file if `repair`."""
    if not path.exists():
        return []
    data = path.read_bytes()
    rows, good_end = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"{path}: line {len(rows) + 1} is not valid JSON ({err.msg}); the file was edited or "
                "corrupted: move it away to start the run afresh"
            ) from err
        good_end += len(line)
    if repair and good_end < len(data):
        with path.open("r+b") as f:
            f.truncate(good_end)
    return rows


def write_failed(path: Path, err: OSError) -> ConfigError:
    return ConfigError(
        f"could not write {path} ({err.strerror or err}); the rows already written are intact: free disk space "
        "or fix the folder's permissions, then add resume=true to continue"
    )


class RecordWriter:
    """Appends rows to samples.jsonl, each flushed to disk before the next sample starts."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = path.open("ab")
        except OSError as err:
            raise write_failed(path, err) from None

    def write(self, row: dict[str, Any]) -> None:
        start = self._file.tell()
        try:
            self._file.write((json.dumps(row, sort_keys=True) + "\n").encode())
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:
            self._undo(start)
            raise write_failed(self.path, err) from None

    def _undo(self, start: int) -> None:
        """Cut what a failed write left after the last whole row (a torn line is also cut when the run resumes)."""
        self.close()
        try:
            os.truncate(self.path, start)
        except OSError:
            pass

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:
                pass  # the buffered bytes could not be flushed: nothing more reached the file


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: a crash leaves either the old file or the new one, never half of either."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise write_failed(path, err) from None


def versions() -> dict[str, str]:
    """Versions the results depend on."""
    import hydra
    import torch
    import transformers

    import evalkit

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hydra": hydra.__version__,
        "evalkit": evalkit.__version__,
        "evalkit_git": git_sha(),
    }


def git_sha() -> str:
    """The evalkit checkout's commit (with '+dirty' for uncommitted changes), or 'unknown' when installed."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def config_differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs
