"""A policy's parameter as the command line names it: a policy names its own keys (`window=0: ...`,
evalkit.errors.ParamError); the command line knows how the user wrote the policy, so it adds `policy.` for
`policy=snapkv policy.window=0`, and names the variant for `variants=[...]` and `search.policies=[...]`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig

from evalkit.errors import ParamError


def as_written(err: ParamError, cfg: DictConfig, variant: str = "") -> ParamError:
    """`err` as the user wrote the policy: `policy.window=0: ...` for policy=..., else after the variant's name,
    `variant` (`variants: snapkv@0.25: window=0: ...`; none: the error's place names it, as a sample's check does)."""
    for key in ("variants", "search.policies"):
        listed = cfg.get(key) if key == "variants" else (cfg.get("search") or {}).get("policies")
        if listed:
            return err.at(f"{key}: {variant}") if variant else err
    return err.within("policy.")


@contextmanager
def policy_keys(cfg: DictConfig, variant: str = "") -> Iterator[None]:
    """Around a call into the policy of variant `variant`: its ParamError as the user wrote the policy (as_written)."""
    try:
        yield
    except ParamError as err:
        raise as_written(err, cfg, variant) from None
