"""The names a config group accepts, found in evalkit's conf/ and the user's folders on Hydra's search path, and a
mistyped one refused with the nearest name: with no torch, no model and no policy class loaded, so that a typo is
answered at once."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from importlib.resources import files
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from evalkit.errors import ConfigError

GROUPS = ("model", "policy", "quant", "prefill", "task", "gate", "logger", "backend")


# `hydra.searchpath=[file://my_conf]` adds a folder of the user's own configs: my_conf/policy/oldest.yaml is then
# `policy=oldest`, `variants=[oldest@0.5]` and `chunkkv(oldest)`. Hydra looks in evalkit's conf/ first, so a user's
# config named like one of evalkit's would be silently ignored: that is refused instead (shadowed).
_SEARCHPATH: ContextVar[tuple[str, ...] | None] = ContextVar("evalkit_searchpath", default=None)


SEARCHPATH_HINT = "your own configs: put NAME.yaml in FOLDER/{group}/ and add hydra.searchpath=[file://FOLDER]"


def searchpath_of(overrides: list[str]) -> tuple[str, ...]:
    """The folders a command line's `hydra.searchpath=[...]` adds (a malformed one is left to the pre-check)."""
    for arg in reversed(overrides):
        if arg.lstrip("+").partition("=")[0] != "hydra.searchpath":
            continue
        try:
            value = OverridesParser.create().parse_override(arg.lstrip("+")).value()
        except HydraException:
            return ()
        return tuple(str(v) for v in value) if isinstance(value, list) else (str(value),)
    return ()


@contextmanager
def searching(searchpath: tuple[str, ...] | list[str]) -> Iterator[None]:
    """Look configs up on this search path (the pre-check, before Hydra runs the job)."""
    token = _SEARCHPATH.set(tuple(searchpath))
    try:
        yield
    finally:
        _SEARCHPATH.reset(token)


def searchpath() -> tuple[str, ...]:
    """The search path of the config being checked or run: set by `searching`, else Hydra's job's, else none."""
    active = _SEARCHPATH.get()
    if active is not None:
        return active
    if HydraConfig.initialized():
        return tuple(str(p) for p in HydraConfig.get().searchpath or ())
    return ()


def _user_folders(group: str, path: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(as shown, folder) of each search-path entry's `group` folder: file://DIR and pkg://module entries."""
    out = []
    for entry in path:
        scheme, _, where = entry.partition("://")
        try:
            folder = Path(where) / group if scheme == "file" else files(where.replace("/", ".")) / group
        except (ModuleNotFoundError, TypeError):
            continue
        if scheme in ("file", "pkg"):
            out.append((f"{entry.rstrip('/')}/{group}", folder))
    return out


def _names(folder) -> set[str]:
    try:
        return {p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")} if folder.is_dir() else set()
    except OSError:
        return set()


def options(group: str, path: tuple[str, ...] | None = None) -> list[str]:
    """The names a config group accepts: its YAML files in evalkit's conf/ and in the search path's folders (`path`,
    by default the active search path)."""
    names = _names(files("evalkit.conf").joinpath(group))
    for _, folder in _user_folders(group, searchpath() if path is None else path):
        names |= _names(folder)
    return sorted(names)


def check_shadowed(group: str, name: str, path: tuple[str, ...] | None = None) -> None:
    """ConfigError when a user's config has the name of one of evalkit's, which Hydra would take instead."""
    if name not in _names(files("evalkit.conf").joinpath(group)):
        return
    for shown, folder in _user_folders(group, searchpath() if path is None else path):
        if name in _names(folder):
            raise ConfigError(
                f"{shown}/{name}.yaml has the name of evalkit's own {group} {name!r}, which Hydra takes first: "
                f"rename yours (the file and its name:), e.g. my_{name}.yaml"
            )


def unknown_choice(group: str, name: str, path: tuple[str, ...], where: str = "", within: str = "") -> ConfigError:
    """`{where}unknown policy 'snapk'{within} (did you mean snapkv?); valid names: ...`"""
    valid = options(group, path)
    mine = "" if path else f"; {SEARCHPATH_HINT.format(group=group)}"
    return ConfigError(
        f"{where}unknown {group} {name!r}{within}{did_you_mean(name, valid)}; valid names: {', '.join(valid)}{mine}"
    )


def did_you_mean(name: str, valid: list[str]) -> str:
    """` (did you mean NEAR?)` for the valid name nearest a mistyped one, or nothing when none is near."""
    near = difflib.get_close_matches(str(name), valid, n=1)
    return f" (did you mean {near[0]}?)" if near else ""


def check_choices(overrides: list[str]) -> None:
    """Reject `group=name` overrides that name no config, listing the valid names (and the nearest one)."""
    path = searchpath_of(overrides)
    for arg in overrides:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep or key not in GROUPS or value.startswith(("glob(", "choice(", "range(")):
            continue
        valid = options(key, path)
        for name in value.split(","):
            if name not in valid:
                raise unknown_choice(key, name, path)
            check_shadowed(key, name, path)
