"""Learned weights a policy reads from a local file (`policy.weights_path`): the file found, its tensors read and
checked against the model, and what run.json records of it. evalkit never reaches the Hub at run time."""

from __future__ import annotations

import hashlib
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from evalkit.errors import ParamError


def weights_file(path: str) -> Path:
    """The file `path` names: itself, or model.safetensors in the folder; a ConfigError if there is none."""
    p = Path(path).expanduser()
    p = p / "model.safetensors" if p.is_dir() else p
    if not p.is_file():
        raise ParamError({"weights_path": path}, ": no such file (model.safetensors in a folder, or the file)")
    return p


def read_tensors(path: str, names: tuple[str, ...], what: str, fetch: str) -> dict[str, Tensor]:
    """The tensors `names` of the safetensors file `path` names, or a ConfigError saying it is not `what`."""
    try:
        tensors = load_file(str(weights_file(path)))
        return {n: tensors[n] for n in names}
    except (SafetensorError, KeyError, OSError) as err:
        raise ParamError({"weights_path": path}, f": not {what} ({err}); {fetch}") from None


def head_dim(config) -> int:
    """A text config's head dimension (`head_dim`, or hidden size over attention heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_shape(path: str, what: str, got: tuple, want: tuple, axes: str, fetch: str) -> None:
    """A ConfigError unless the weights' shape `got` is the model's `want` (its `axes` in words)."""
    if tuple(got) != tuple(want):
        raise ParamError(
            {"weights_path": path},
            f": {what} of shape {tuple(got)}, the model needs ({axes}) = {tuple(want)}: "
            f"they are another model's; {fetch}",
        )


def recorded(path: Path) -> dict[str, str]:
    """What run.json's `prepared` records of a weights file: its full path and SHA-256."""
    return {"weights_path": str(path.resolve()), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
