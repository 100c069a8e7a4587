"""A policy names its own parameter (`window=0: ...`); the command line adds `policy.` (or names the variant), and a
wrapper adds `inner.` to its inner policy's keys, structurally (evalkit.errors.ParamError)."""

from __future__ import annotations

import dataclasses
import pickle
import typing

import pytest

from evalkit.cli.config import build, policy_from
from evalkit.cli.precheck import precheck
from evalkit.config.choices import options
from evalkit.contract.checks import check_declared
from evalkit.contract.policy import KVPolicy
from evalkit.contract.wrapper import Wrapper
from evalkit.errors import ConfigError, ParamError, PolicyError
from evalkit.policies.chunkkv import ChunkKV
from evalkit.policies.snapkv import SnapKV
from tests.conftest import WEIGHTS_TINY, compose_config

BASE_FIELDS = {f.name for f in dataclasses.fields(Wrapper)} | {f.name for f in dataclasses.fields(KVPolicy)}


def required(name: str) -> list[str]:
    """The settings a shipped policy cannot run without (its learned weights, DMS's threshold)."""
    given = [f"policy.weights_path={WEIGHTS_TINY[name]}"] if name in WEIGHTS_TINY else []
    if name == "dms":
        given += ["policy.threshold=-9", f"policy.inner.weights_path={WEIGHTS_TINY['kvzap']}"]
    return given + (["protocol=query_aware"] if name == "finch" else [])


def shipped(name: str) -> KVPolicy:
    cfg = compose_config(f"policy={name}", "model=tiny-random", *required(name))
    return build(cfg.policy, "policy")


def bad_values(hint: object) -> list[object]:
    """Values of a field's own type that a range check may refuse: negative, zero, beyond a share, an unknown word."""
    kinds = set(typing.get_args(hint)) or {hint}
    if int in kinds and bool not in kinds:
        return [-1, 0]
    if float in kinds:
        return [-1.0, 1.5]
    if str in kinds:
        return ["nonsense"]
    return []


def refused(policy: KVPolicy) -> list[tuple[str, object, ParamError]]:
    """Each own field of `policy` set, one at a time, to a bad value its validation refuses with a ParamError."""
    hints = typing.get_type_hints(type(policy))
    out = []
    for f in dataclasses.fields(policy):
        if f.name in BASE_FIELDS:
            continue
        for value in bad_values(hints.get(f.name)):
            try:
                dataclasses.replace(policy, **{f.name: value}).validate(None)
            except ParamError as err:
                out.append((f.name, value, err))
                break
            except ConfigError:
                continue
    return out


@pytest.mark.parametrize("name", options("policy"))
def test_every_policy_names_its_own_key_and_the_command_line_adds_policy(name):
    policy = shipped(name)
    policy.validate(None)  # the shipped settings pass
    with pytest.raises(ParamError) as err:
        dataclasses.replace(policy, budget=0).validate(None)
    assert err.value.key == "budget" and str(err.value).startswith("budget=0") and "policy." not in str(err.value)
    found = refused(policy)
    for key, _, err in found:
        assert key in err.values and "policy." not in str(err), str(err)
        assert str(err).startswith(f"{next(iter(err.values))}="), str(err)
    # on the command line (the first number refused: one precheck per policy, as they take a while)
    for key, value, _ in [f for f in found if not isinstance(f[1], str) and name != "dms"][:1]:
        with pytest.raises(ConfigError) as cli:
            precheck(["model=tiny-random", f"policy={name}", *required(name), f"policy.{key}={value}"])
        assert f"policy.{key}={value}" in str(cli.value) and "\n" not in str(cli.value), str(cli.value)


def test_the_walk_reaches_the_range_checks_of_most_policies():
    """The walk above must not pass vacuously: most policies refuse a bad value of one of their own fields."""
    checked = [name for name in options("policy") if refused(shipped(name))]
    assert len(checked) >= 25, checked
    assert {"snapkv", "h2o", "pyramidkv", "streaming_llm", "chunkkv", "lagkv", "think"} <= set(checked)


def test_a_wrapper_names_its_inner_policys_key_under_inner():
    with pytest.raises(ParamError) as err:
        ChunkKV(inner=SnapKV(window=0), budget=0.5).validate(None)
    assert err.value.key == "inner.window" and err.value.values == {"window": 0}
    assert str(err.value).startswith("inner.window=0: the observation window needs at least 1 query; ")
    assert str(err.value).endswith("give e.g. inner.window=32")  # a key the problem names is prefixed alike
    assert str(err.value.within("policy.")).startswith("policy.inner.window=0: ")
    with pytest.raises(ParamError) as typed:  # the inner policy's fields against their annotations, alike
        ChunkKV(inner=SnapKV(window=1.5), budget=0.5).validate(None)
    assert str(typed.value) == "inner.window=1.5 is not a whole number; give e.g. inner.window=32"


def test_a_nested_wrapper_adds_inner_once_per_level():
    inner = policy_from("chunkkv(snapkv)")
    deep = dataclasses.replace(inner, inner=dataclasses.replace(inner.inner, kernel=2))
    outer = policy_from("chunkkv(snapkv)")
    with pytest.raises(ParamError) as err:
        dataclasses.replace(outer, inner=deep).validate(None)
    assert err.value.key == "inner.inner.kernel"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["policy=snapkv", "policy.window=0"],
            "policy.window=0: the observation window needs at least 1 query; give e.g. policy.window=32",
        ),  # fmt: skip
        (["policy=chunkkv", "policy.inner={name:snapkv,kernel:2}"], "policy.inner.kernel=2 must be an odd number"),
        (["policy=snapkv", "policy.budget=0"], "policy.budget=0 keeps no token"),
        (["variants=[snapkv@0.25,h2o@0]"], "variants: h2o@0: budget=0 keeps no token"),
        (["variants=[snapkv@0.25,h2o@1.5]"], "variants: h2o@1.5: budget=1.5 is outside (0, 1]"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_the_command_line_names_the_parameter_as_the_user_wrote_it(argv, message):
    with pytest.raises(ConfigError) as err:
        precheck(["model=tiny-random", *argv])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_param_error_is_composed_from_its_parts_and_survives_a_sweeps_pickling():
    err = ParamError({"tau": 0, "epsilon": -1.0}, ": give tau > 0 and $epsilon >= 0")
    assert str(err) == "tau=0, epsilon=-1.0: give tau > 0 and epsilon >= 0"
    named = err.within("inner.").within("policy.").at("sample 'a' (40 context tokens)")
    assert str(named) == (
        "sample 'a' (40 context tokens): policy.inner.tau=0, policy.inner.epsilon=-1.0: give tau > 0 and "
        "policy.inner.epsilon >= 0"
    )
    again = pickle.loads(pickle.dumps(named))
    assert isinstance(again, ParamError) and str(again) == str(named) and again.key == "policy.inner.tau"
    assert str(ParamError({"pooling": "median", "decode": True, "pattern": None}, " is wrong")) == (
        "pooling='median', decode=true, pattern=null is wrong"
    )


@dataclasses.dataclass(kw_only=True)
class SilentAdder(SnapKV):
    """Defines added() but forgets adds_tokens: the engine would never ask for its tokens."""

    def added(self, view):
        return None


def test_a_policy_that_adds_tokens_without_declaring_it_is_refused():
    for policy in (SilentAdder(budget=0.5), ChunkKV(inner=SilentAdder(budget=0.5), budget=0.5)):
        with pytest.raises(PolicyError, match="defines added\\(\\) but does not declare adds_tokens.*adds_tokens: "):
            check_declared(policy)
    check_declared(ChunkKV(inner=SnapKV(budget=0.5), budget=0.5))  # the contract's added(): nothing to declare
    declared = type("DeclaredAdder", (SilentAdder,), {"adds_tokens": True, "__module__": __name__})
    check_declared(dataclasses.dataclass(kw_only=True)(declared)(budget=0.5))
