"""Shared fixtures: a tiny random Llama (no download) and helpers to compose evalkit's Hydra config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

import evalkit.__main__  # noqa: F401  (registers the evalkit_or resolver used by the run-dir pattern)
from evalkit import models

ROOT = Path(__file__).resolve().parent.parent


def compose_config(*overrides: str) -> DictConfig:
    with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="session")
def tiny():
    """The tiny-random model from conf/model/tiny-random.yaml, loaded once."""
    return models.load(OmegaConf.load(ROOT / "conf" / "model" / "tiny-random.yaml"), "cpu")


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """`python -m evalkit ARGS` in a subprocess, as a user runs it."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "evalkit", *args],
        cwd=cwd or ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
