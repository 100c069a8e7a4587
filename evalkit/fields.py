"""A dataclass's fields checked against their annotations, and the one-line errors that name a key, its type and an
example: shared by policies, tasks and the command line."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Union

from evalkit.errors import ConfigError, ParamError, written


def number(value: Any, kinds: tuple[type, ...] = (int, float)) -> bool:
    """`value` is a finite number of one of `kinds` (never a boolean). An int is finite whatever its size; asking
    math.isfinite of one too large for a float (a 401-digit count) would raise OverflowError."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        return False
    return isinstance(value, int) or math.isfinite(value)


def fits(value: Any, hint: Any) -> bool:
    """Whether `value` (as OmegaConf hands it over, lists converted) is of the annotated type. Strict where YAML is
    loose: a bool is not an int, 1.5 is not an int, 1 is a float (YAML and Hydra write 2.0 as 2 in places)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and (not args or all(fits(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return not isinstance(hint, type) or isinstance(value, hint)


_NAMES = {bool: ("true or false", "booleans"), int: ("a whole number", "whole numbers"), float: ("a number", "numbers")}


def describe(hint: Any, plural: bool = False) -> str:
    """The annotated type in words: `a whole number`, `a list of numbers`, `a whole number or null`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        words = "a number" if set(kinds) == {int, float} else " or ".join(describe(a, plural) for a in kinds)
        return words + (" or null" if len(kinds) < len(args) else "")
    if origin in (list, tuple):
        return "lists" if plural else f"a list of {describe(args[0], True) if args else 'values'}"
    if hint in _NAMES:
        return _NAMES[hint][plural]
    if hint is str:
        return "strings" if plural else "a string"
    return getattr(hint, "__name__", str(hint))


def cli(value: Any) -> str:
    """A value as written on the command line, unquoted: true, null, [0.25,0.5], avg."""
    return written(value, quoted=False)


def example(key: str, value: Any) -> str:
    """`key=value` to type, quoted for the shell when it holds brackets."""
    text = f"{key}={cli(value)}"
    return f"'{text}'" if any(c in text for c in "[]{}*?") else text


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def check_fields(obj: Any, prefix: str = "") -> None:
    """ParamError for the first field of a dataclass instance whose value does not fit its annotation, its key under
    `prefix` (a policy's fields: none, the command line adds `policy.`), e.g.
    `task.samples_per_cell=1.5 is not a whole number; give e.g. task.samples_per_cell=1`."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in hints and not fits(value, hints[f.name]):
            default = default_of(f)
            fix = f"give e.g. {example('$' + f.name, default)}" if default is not None else "correct the value"
            raise ParamError(
                {f.name: value}, f" is not {describe(hints[f.name])}; {fix}", f"{prefix}." if prefix else ""
            )


def init_fields(cls: type) -> list[str]:
    """The keys a dataclass takes (its __init__ arguments), sorted."""
    return sorted(f.name for f in dataclasses.fields(cls) if f.init)


def unknown_key(key: str, valid: list[str], parent: str = "") -> ConfigError:
    """`unknown key policy.budgt (did you mean policy.budget?); valid keys: budget, decode, ...`"""
    where = f"{parent}." if parent else ""
    near = difflib.get_close_matches(key.rpartition(".")[2], valid, n=1)
    hint = f" (did you mean {where}{near[0]}?)" if near else ""
    return ConfigError(f"unknown key {key}{hint}; valid keys: {', '.join(valid)}")
