"""Weights & Biases runs: one per (evalkit run, variant), with ids a later command derives again.

A run's W&B id comes from its evalkit identity (run.json's `run_id`, kept across resumes) and the variant's name, so
`python -m evalkit.gate --wandb` and an extended run log to the very runs `logger=wandb` created. Where they went
(project, entity, group, mode, folder) is written beside the records, in `wandb.json`. Plain values only.

One id, one run: every write is the whole run (evalkit.report.wandb_log). Online, W&B resumes the run of the id
(resume="allow"). Offline, W&B cannot append to an offline run: each init writes a new offline-run-TIME-ID folder,
and `wandb sync` of a second folder of one id replaces what the first uploaded (wandb/wandb#3841, #5865). So once the
whole run is written again, the id's earlier offline folders are removed: the folder left is the run, complete, and
`offline_runs` counts them.
"""

from __future__ import annotations

import hashlib
import json
import netrc
import os
import shutil
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from evalkit.errors import ConfigError
from evalkit.records import finite, write_json

SETTINGS = "wandb.json"
MODES = ("auto", "online", "offline", "disabled")


@dataclass(frozen=True)
class Target:
    """Where a run's W&B runs go; `dir` holds W&B's local files (its `wandb/` folder)."""

    project: str
    group: str
    dir: str
    entity: str | None = None
    mode: str = "auto"


def run_id(identity: str, variant: str) -> str:
    """The W&B run id of one variant of one evalkit run: the same on every call, distinct across runs and variants."""
    return hashlib.sha256(f"{identity}\0{variant}".encode()).hexdigest()[:16]


def resolved_mode(mode: str) -> str:
    """`auto`: online when an API key is configured, offline otherwise (`wandb sync` uploads later)."""
    if mode not in MODES:
        raise ConfigError(f"logger.mode={mode!r}: give one of {', '.join(MODES)}")
    if mode == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return mode


def has_credentials() -> bool:
    """Whether W&B can log in without asking: WANDB_API_KEY, or the netrc entry `wandb login` writes for the host of
    WANDB_BASE_URL (api.wandb.ai by default)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        entry = netrc.netrc(os.environ.get("NETRC")).authenticators(host)
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one that cannot be read: no key in it
        return False
    return bool(entry and entry[2])


def check_online(mode: str) -> None:
    """A ConfigError, before any sample runs, when logger.mode asks W&B to log online without credentials: W&B
    would otherwise refuse only once the whole run is done, and the gate would never run."""
    if resolved_mode(mode) == "online" and not has_credentials():
        raise ConfigError(
            "logger.mode=online but no W&B API key is set (WANDB_API_KEY, or `wandb login`): log in, or use "
            "logger.mode=offline and upload later with `wandb sync`"
        )


def save_target(folder: Path, target: Target, runs: dict[str, str]) -> None:
    """Record in the run folder where its W&B runs went, and each variant's run id."""
    write_json(folder / SETTINGS, {**asdict(target), "runs": runs})


def load_target(folder: Path) -> Target | None:
    """The Target `save_target` recorded in the run folder, or None when the run was never logged to W&B."""
    path = folder / SETTINGS
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        return Target(**{k: doc[k] for k in ("project", "group", "dir", "entity", "mode")})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path} cannot be read ({err}); remove it to log to new W&B runs") from None


def log_to_run(
    target: Target,
    wandb_id: str,
    name: str,
    config: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
    media: dict[str, Any] | None = None,
    artifact: Any = None,
) -> Path:
    """Open (or resume) the W&B run `wandb_id`, add the config, summary fields, media and an artifact; return its
    local folder. `media` and `artifact` are the caller's, built with the `wandb` package. Offline, the id's earlier
    offline folders are removed once it is written: what is written is the whole run (see the module's note)."""
    mode = resolved_mode(target.mode)
    earlier = offline_runs(Path(target.dir)).get(wandb_id, []) if mode == "offline" else []
    run = wandb_package().init(
        id=wandb_id,
        resume="allow",
        project=target.project,
        entity=target.entity,
        group=target.group,
        name=name,
        mode=mode,
        dir=target.dir,
        config=finite(config or {}),
        reinit="finish_previous",
    )
    run.summary.update(finite(summary or {}))
    if media:
        run.log(media)
    if artifact is not None:
        run.log_artifact(artifact)
    local = Path(run.dir).parent
    run.finish()
    for old in earlier:  # replaced by the whole run just written (kept where writing it failed)
        if old.resolve() != local.resolve():
            shutil.rmtree(old, ignore_errors=True)
    return local


def offline_runs(folder: Path) -> dict[str, list[Path]]:
    """The offline W&B run folders under `folder`/wandb by run id: offline-run-TIME-ID, or offline-run-TIME-ID-N where
    two runs of one id started in the same second (W&B's sync-dir suffix). One id, one folder: see the module's note."""
    out: dict[str, list[Path]] = defaultdict(list)
    for local in sorted((folder / "wandb").glob("offline-run-*")):
        parts = local.name.split("-")
        if local.is_dir() and len(parts) >= 4:
            out[parts[3]].append(local)
    return dict(out)


def wandb_package():
    """The `wandb` package, imported only when something is logged to W&B (it is optional, and slow to import)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "logging to W&B needs the wandb package: pip install wandb (or drop logger=wandb / --wandb)"
        ) from None
    return wandb
