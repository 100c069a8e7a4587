"""Append-only results: `samples.jsonl` (one row per sample x variant, flushed as each finishes) and `run.json`.

A killed run loses at most the row in flight: rows are written whole, flushed and fsynced; a torn last line
left by a kill is cut off when the run resumes.
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


class RecordWriter:
    """Appends rows to samples.jsonl, each flushed to disk before the next sample starts."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically: a crash leaves either the old file or the new one, never half of either."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


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
