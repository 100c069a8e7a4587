"""A gate's thresholds as plain values: conf/gate/NAME.yaml, a YAML file of the user's, or a composed config's
`gate` node, their interpolations resolved. The gate (evalkit.thresholds) types and ranges them; it never sees
OmegaConf."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evalkit.errors import ConfigError


def read(name_or_path: str) -> Any:
    """conf/gate/NAME.yaml (a name without a suffix) or a YAML path, resolved: usually a mapping of thresholds (the
    gate refuses anything else in one line)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = Path(str(files("evalkit.conf") / "gate" / f"{name_or_path}.yaml"))
    if not path.is_file():
        raise ConfigError(f"gate {name_or_path!r}: no such gate config (conf/gate/<name>.yaml or a YAML path)")
    try:
        node = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001 - YAML or OmegaConf errors: a file the user wrote
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"gate {name_or_path!r}: {path} is not valid YAML ({first}); fix the file") from None
    return resolved(node, repr(name_or_path))


def resolved(node: Any, where: str) -> Any:
    """The gate config as plain values, its interpolations resolved; one that cannot be (`max_drop: ${nope}`) is a
    ConfigError naming the key."""
    try:
        return OmegaConf.to_container(OmegaConf.create(node), resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "a threshold"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(
            f"gate {where}: {key} cannot be resolved ({first}); give {key} a value (conf/gate/default.yaml has each)"
        ) from None
