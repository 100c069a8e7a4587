"""`search.budgets=[...]` (and `search.policies=[...]`): a budget search as variants of one run, each policy at every
budget on the same samples (one prefill per sample for them all), judged with one error rate by the gate
(evalkit.gate.search)."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from evalkit.cli.config import build, parse_variant, quant_spec
from evalkit.config.choices import options
from evalkit.errors import ConfigError
from evalkit.kv.variant import Variant

EXAMPLE = "'search.budgets=[0.75,0.5,0.35,0.25]'"


def budgets(cfg: DictConfig) -> list[int | float]:
    """search.budgets, checked: fractions of the context in (0, 1] or token counts >= 1, one kind, each once."""
    node = cfg.get("search") or {}
    listed = node.get("budgets")
    if listed is None or (isinstance(listed, (list, ListConfig)) and not listed):
        return []
    if not isinstance(listed, (list, ListConfig)):
        raise ConfigError(f"search.budgets={listed!r} is not a list; write e.g. {EXAMPLE}")
    out = list(listed)
    for b in out:
        if (
            isinstance(b, bool)
            or not isinstance(b, (int, float))
            or not (0 < b <= 1 if isinstance(b, float) else b >= 1)
        ):
            raise ConfigError(
                f"search.budgets: {b!r} is not a budget: give fractions of the context in (0, 1] (0.25) or whole "
                f"numbers of tokens (512), e.g. {EXAMPLE}"
            )
    if len({isinstance(b, float) for b in out}) > 1:
        raise ConfigError(f"search.budgets={out}: give fractions (0.25) or token counts (512), not both")
    if len(set(out)) != len(out):
        raise ConfigError(f"search.budgets={out}: {sorted({b for b in out if out.count(b) > 1})} listed more than once")
    return sorted(out, reverse=True)


def check(cfg: DictConfig) -> None:
    """A search the command line cannot run: with variants=[...], or on another engine."""
    if not budgets(cfg):
        if (cfg.get("search") or {}).get("policies"):
            raise ConfigError(f"search.policies is given without search.budgets: add them, e.g. {EXAMPLE}")
        return
    if cfg.get("variants"):
        raise ConfigError("search.budgets and variants=[...] are both given: a search makes its own variants; drop one")
    engine = (cfg.get("backend") or {}).get("name", "hf")
    if engine != "hf":
        raise ConfigError(f"a budget search runs on evalkit's own engine (backend=hf), not backend={engine}")


def variants(cfg: DictConfig) -> list[Variant]:
    """Every policy of the search at every budget, largest first: `search.policies` entries (`snapkv`,
    `snapkv+int4`, a conf/quant name alone for quantized storage of the full cache, `int4`), or `policy` with its
    settings and `quant` when none are listed."""
    steps = budgets(cfg)
    policies = (cfg.get("search") or {}).get("policies") or []
    if not isinstance(policies, (list, ListConfig)):
        raise ConfigError(f"search.policies={policies!r} is not a list; write e.g. 'search.policies=[snapkv,h2o]'")
    if not policies:
        return [_own(cfg, b) for b in steps]
    out = []
    quants = options("quant")
    for entry in (str(p) for p in policies):
        if "@" in entry:
            raise ConfigError(
                f"search.policies: {entry!r} names a budget; list policies alone (the budgets are search.budgets)"
            )
        name, _, quant = entry.partition("+")
        if name in quants and name not in options("policy"):
            out.append(parse_variant(cfg, f"none@1.0+{name}"))  # quantized storage alone: one step, no budget
            continue
        out += [parse_variant(cfg, f"{name}@{b}" + (f"+{quant}" if quant else "")) for b in steps]
    return out


def _own(cfg: DictConfig, budget: int | float) -> Variant:
    """`policy` as configured (its settings kept), at `budget`, stored as `quant` asks."""
    node = OmegaConf.create({"seed": cfg.seed, "policy": OmegaConf.to_container(cfg.policy, resolve=True)})
    node.policy.budget = budget
    return Variant(build(node.policy, "policy"), quant_spec(cfg.quant))
