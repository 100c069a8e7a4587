"""Your own policy, first-class: a class outside evalkit and its YAML in your own config folder (Hydra's search path)
run with `policy=NAME`, in `variants=[...]` beside evalkit's policies, inside a wrapper and under the gate; a
`_target_` that cannot be imported or is not a KVPolicy is one line, exit 2.

The module below holds the README's example (README, Write a policy) as it is written there, and `Oldest`, whose
choice is known by hand: it keeps the first tokens of the context.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from evalkit.cli.config import variants
from evalkit.cli.precheck import precheck
from evalkit.config.choices import check_choices, options, searching
from evalkit.errors import ConfigError
from tests.conftest import compose_config, importable, run_cli

MODULE = '''
"""my_policies.py: keep the tokens whose values have the largest L2 norm, and always the most recent ones."""

from dataclasses import dataclass

from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class ValueNorm(KVPolicy):
    name: str = "vnorm"
    recent: int = 8  # the most recent tokens, always kept
    decode: bool = False  # compress once, after the prompt

    def score(self, view: LayerView) -> Tensor:
        return view.values.float().norm(dim=-1)  # (B, Hkv, T): each KV head ranks its own tokens

    def protected(self, view: LayerView, k: int) -> Tensor:
        return view.positions >= view.seen - self.recent

    def min_tokens(self) -> int:
        return self.recent + 1

    def check_params(self) -> None:
        if self.recent < 0:
            raise ParamError({"recent": self.recent}, " is negative; give e.g. $recent=8")


@dataclass(kw_only=True)
class Oldest(KVPolicy):
    name: str = "oldest"
    decode: bool = False

    def score(self, view: LayerView) -> Tensor:
        return -view.positions.float()  # the older, the higher


@dataclass(kw_only=True)
class KeepsMore(KVPolicy):
    name: str = "keepsmore"
    decode: bool = False

    def score(self, view: LayerView) -> Tensor:
        return view.positions.float()

    def target(self, seen: int) -> int:
        return -(-9 * seen // 10)  # 90% of the tokens, whatever the budget


class NotAPolicy:
    pass
'''

YAMLS = {
    "vnorm": "_target_: my_policies.ValueNorm\nname: vnorm\nbudget: 0.25\nrecent: 8\ndecode: false\n",
    "oldest": "_target_: my_policies.Oldest\nname: oldest\nbudget: 0.5\n",
    "keepsmore": "_target_: my_policies.KeepsMore\nname: keepsmore\nbudget: 0.25\n",
    "ghost": "_target_: no_such_module.Ghost\nname: ghost\n",
    "impostor": "_target_: my_policies.NotAPolicy\nname: impostor\n",
    "untargeted": "name: untargeted\nbudget: 0.5\n",
    # a user's config may extend one of evalkit's through Hydra's defaults list
    "snap16": "defaults:\n  - snapkv\n  - _self_\nname: snap16\nwindow: 16\n",
}

TINY = ["model=tiny-random", "task.context_lengths=[128]"]


def user_policies(tmp_path, monkeypatch, module: str, source: str, yamls: dict[str, str]) -> tuple[Path, Path]:
    """(folder of `module`.py, config folder with a policy YAML per name in `yamls`), the module importable here too
    (for the in-process checks)."""
    src, conf = tmp_path / "src", tmp_path / "my_conf"
    src.mkdir()
    (conf / "policy").mkdir(parents=True)
    (src / f"{module}.py").write_text(textwrap.dedent(source))
    for name, text in yamls.items():
        (conf / "policy" / f"{name}.yaml").write_text(text)
    importable(monkeypatch, src, module)
    return src, conf


@pytest.fixture
def user(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(folder of my_policies.py, config folder with YAMLS)."""
    return user_policies(tmp_path, monkeypatch, "my_policies", MODULE, YAMLS)


def cli(user, *args, run_dir: Path):
    src, conf = user
    return run_cli(*args, f"hydra.searchpath=[file://{conf}]", f"hydra.run.dir={run_dir}", env={"PYTHONPATH": str(src)})


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def test_own_policy_runs_alone_under_the_gate(user, tmp_path):
    run_dir = tmp_path / "run"
    result = cli(user, *TINY, "task.depths=[0.5]", "policy=vnorm", "gate=default", "gate.min_baseline_accuracy=null",
                 run_dir=run_dir)  # fmt: skip
    # the tiny random model finds no needle; one sample shows nothing either way: the gate says so (exit 2)
    assert result.returncode == 2 and "evalkit gate: INCONCLUSIVE" in result.stdout, result.stderr
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert "vnorm@0.25" in verdict["variants"]  # judged by its name
    (row,) = [r for r in rows(run_dir) if r["variant"] != "baseline"]
    # its name and fields
    assert row["policy"] == {
        "class": "my_policies.ValueNorm",  # what ran: the class its _target_ names
        "name": "vnorm",
        "budget": 0.25,
        "decode": False,
        "decode_interval": 1,
        "recent": 8,
    }
    assert row["context_tokens"] == 128
    assert row["tokens_held_per_layer"] == [32] * 3  # ceil(0.25 * 128) in each of the 3 layers


def test_own_policy_in_a_sweep_beside_builtin_ones_and_inside_a_wrapper(user, tmp_path):
    listed = 'variants=[oldest@0.5,vnorm@40,snapkv@0.5,"chunkkv(oldest)@40"]'
    result = cli(user, *TINY, "task.depths=[0.0,1.0]", listed, run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stderr
    got = rows(tmp_path / "run")
    assert len({r["sample_id"] for r in got}) == 2 and len(got) == 2 * 5  # baseline + 4 variants, same samples
    held = {"oldest@0.5": math.ceil(0.5 * 128), "vnorm@40": 40, "snapkv@0.5": 64, "chunkkv(oldest)@40": 40}
    for r in got:
        assert r["context_tokens"] == 128
        assert r["tokens_held_per_layer"] == [held.get(r["variant"], 128)] * 3, r["variant"]
    oldest = {r["cell"]["depth"]: r for r in got if r["variant"] == "oldest@0.5"}
    assert oldest[0.0]["policy"] == {
        "class": "my_policies.Oldest",
        "name": "oldest",
        "budget": 0.5,
        "decode": False,
        "decode_interval": 1,
    }
    # Oldest keeps positions 0..63: the needle (its sentence is shorter than 64 byte-level tokens) is held whole at
    # depth 0, at the start of the context, and not at all at depth 1, at its end, in every layer: the user's class
    # made the choice.
    assert oldest[0.0]["evidence_retained_per_layer"] == [1.0] * 3
    assert oldest[1.0]["evidence_retained_per_layer"] == [0.0] * 3
    wrapped = next(r for r in got if r["variant"] == "chunkkv(oldest)@40")
    assert wrapped["policy"]["inner"] == {
        "class": "my_policies.Oldest",  # a wrapper's inner policy is recorded as the policy is: its class too
        "name": "oldest",
        "budget": 40,
        "decode": False,
        "decode_interval": 1,
    }
    assert next(r for r in got if r["variant"] == "vnorm@40")["policy"]["recent"] == 8


def test_a_policy_that_keeps_more_than_its_budget_stops_the_run_with_2(user, tmp_path):
    """keepsmore@0.25 says its target is 90% of the tokens: ceil(0.9 x 128) = 116 held where the budget allows
    ceil(0.25 x 128) = 32 (it declares nothing protected). Before, the run went on, recorded 116 tokens held, and the
    gate PASSed it as keepsmore@0.25 at 0.90x."""
    result = cli(user, *TINY, "task.depths=[0.5]", "policy=keepsmore", run_dir=tmp_path / "run")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "evalkit: error: keepsmore held 116 of 128 tokens per KV head at layer 0, where a budget of 0.25 x 128 = "
        "32 plus the tokens it declares protected allow 32"
    )
    assert "Traceback" not in result.stderr and "bug in evalkit" not in result.stderr


def test_target_that_cannot_be_imported_is_one_line_exit_2(user, tmp_path):
    result = cli(user, *TINY, "policy=ghost", run_dir=tmp_path / "run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "evalkit: error: policy._target_='no_such_module.Ghost' cannot be imported (ModuleNotFoundError: No module "
        "named 'no_such_module'); make 'no_such_module' importable (on PYTHONPATH, or pip install -e your package) "
        "and fix _target_"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["policy=impostor"], "policy._target_='my_policies.NotAPolicy' is not a policy: subclass "),
        (["policy=untargeted"], "policy 'untargeted' has no _target_: name its class in its YAML"),
        (["policy=vnorm", "policy.recent=-1"], "policy.recent=-1 is negative; give e.g. policy.recent=8"),
        (["policy=vnorm", "policy.recnt=1"], "unknown key policy.recnt (did you mean policy.recent?)"),
        (["variants=[vnorm@0.25,ghost@0.5]"], "policy._target_='no_such_module.Ghost' cannot be imported"),
        (["-m", "policy=oldest,impostor"], "[model=tiny-random policy=impostor] policy._target_="),
        (["policy=olds"], "unknown policy 'olds' (did you mean oldest?); valid names: adakv, "),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_own_policies_are_one_line_before_any_model_loads(user, argv, message):
    args = ["model=tiny-random", f"hydra.searchpath=[file://{user[1]}]", *argv]
    with pytest.raises(ConfigError) as err:
        check_choices(args)
        precheck(args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_own_configs_are_looked_up_like_evalkits(user):
    _, conf = user
    path = (f"file://{conf}",)
    assert {"oldest", "vnorm", "snapkv"} <= set(options("policy", path)) and "oldest" not in options("policy")
    precheck(["model=tiny-random", f"hydra.searchpath=[file://{conf}]", "policy=oldest"])
    precheck(["-m", "model=tiny-random", f"hydra.searchpath=[file://{conf}]", "policy=oldest,vnorm,snapkv"])
    with searching(path):
        cfg = compose_config(
            f"hydra.searchpath=[file://{conf}]", "model=tiny-random", 'variants=["chunkkv(snap16)@0.5",oldest@64]'
        )
        snap16, oldest = (v.policy for v in variants(cfg))
    assert snap16.name == "chunkkv(snap16)" and snap16.inner.window == 16 and snap16.inner.kernel == 5
    assert type(oldest).__name__ == "Oldest" and oldest.budget == 64
    # Hydra looks in evalkit's conf/ first: a config of the user's named like one of evalkit's is refused
    (conf / "policy" / "snapkv.yaml").write_text("_target_: my_policies.Oldest\nname: snapkv\n")
    with pytest.raises(ConfigError, match=r"my_conf/policy/snapkv.yaml has the name of evalkit's own policy 'snap"):
        check_choices(["policy=snapkv", f"hydra.searchpath=[file://{conf}]"])
    with pytest.raises(ConfigError, match="rename yours"), searching(path):
        variants(compose_config("model=tiny-random", "variants=[snapkv@0.5]"))
    with pytest.raises(ConfigError, match=r"unknown policy 'oldest'.*add hydra.searchpath=\[file://FOLDER\]"):
        check_choices(["policy=oldest"])


ROGUE = '''
"""my_rogue.py: policies that break the contract in the ways a careless or hostile policy could."""

import math
import os
import signal
from dataclasses import dataclass

from torch import Tensor

from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class Hoarder(KVPolicy):
    """Declares the first 90% of the context protected and keeps that many, whatever its budget."""

    name: str = "hoarder"
    decode: bool = False
    states: int = 1  # what min_tokens() says: the protected tokens it owns up to, plus one

    def score(self, view: LayerView) -> Tensor:
        return -view.positions.float()

    def protected(self, view: LayerView, k: int) -> Tensor:
        return (view.positions >= 0) & (view.positions < int(0.9 * view.seen))

    def target(self, seen: int) -> int:
        return min(seen, int(0.9 * seen) + 1)

    def min_tokens(self) -> int:
        return self.states


@dataclass(kw_only=True)
class Rogue(KVPolicy):
    """Recency, except that `method` ends the run in the way `how` says."""

    name: str = "rogue"
    decode: bool = False
    method: str = ""
    how: str = "raise"  # raise: a RuntimeError; exit0: SystemExit(0); kbd: KeyboardInterrupt; ctrl-c: SIGINT x 2

    def fault(self, method: str) -> None:
        if method != self.method:
            return
        if self.how == "exit0":
            raise SystemExit(0)
        if self.how == "kbd":
            raise KeyboardInterrupt
        if self.how == "ctrl-c":  # the user pressing Ctrl-C twice while score runs: a SIGINT this process receives
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            return
        raise RuntimeError(f"broken {method}")

    def score(self, view: LayerView) -> Tensor:
        self.fault("score")
        return view.positions.float()

    def min_tokens(self) -> int:
        self.fault("min_tokens")
        return 1

    def check_params(self) -> None:
        self.fault("check_params")

    def prepare(self, model, probes):
        self.fault("prepare")
        return None

    def observation_window(self) -> int:
        self.fault("observation_window")
        return 0
'''


@pytest.fixture
def rogue(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(folder of my_rogue.py, config folder with hoarder.yaml and rogue.yaml), importable here too."""
    yamls = {
        "hoarder": "_target_: my_rogue.Hoarder\nname: hoarder\nbudget: 0.25\nstates: 1\n",
        "rogue": "_target_: my_rogue.Rogue\nname: rogue\nbudget: 0.25\n",
    }
    return user_policies(tmp_path, monkeypatch, "my_rogue", ROGUE, yamls)


def test_protected_tokens_count_beyond_the_budget_only_as_the_policy_states_them(rogue, tmp_path):
    """hoarder@0.25 declares positions 0..114 of 128 protected (int(0.9 x 128) = 115 tokens) and keeps
    int(0.9 x 128) + 1 = 116. Before, the protected tokens all counted: the run held 116 of 128 tokens per head, 0.91x
    of the cache, as hoarder@0.25, exit 0. It states min_tokens() = 1, no protected token: its budget,
    ceil(0.25 x 128) = 32, is all it may hold. Stating 116 instead, the budget cannot hold it on a 128-token
    context: refused before the model loads by evalkit.contract.check_policy, which a policy cannot skip (before, by
    the check of each sample, a policy's own validate() being able to check nothing)."""
    result = cli(rogue, *TINY, "task.depths=[0.5]", "policy=hoarder", run_dir=tmp_path / "run")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "evalkit: error: hoarder held 116 of 128 tokens per KV head at layer 0, where a budget of 0.25 x 128 = 32 "
        "plus the tokens it declares protected allow 32 (696 held against 192 allowed over 3 layers"
    ), last  # 3 layers of 2 KV heads: 116 x 6 = 696 held, 32 x 6 = 192 allowed
    assert last.endswith("its budget plus the protected tokens it states, min_tokens() - 1 = 0 per KV head: fix its "
                         "select, target or keep_per_layer")  # fmt: skip
    stated = cli(rogue, *TINY, "task.depths=[0.5]", "policy=hoarder", "policy.states=116", run_dir=tmp_path / "r2")
    assert stated.returncode == 2 and not (tmp_path / "r2" / "samples.jsonl").exists()
    assert stated.stderr.strip().splitlines()[-1] == (
        "evalkit: error: policy.budget=0.25 keeps 32 tokens (a fraction 0.25 of 128 tokens), fewer than the 116 "
        "that hoarder needs (its protected tokens plus one); raise policy.budget"
    )


@pytest.mark.parametrize(
    ("method", "how", "said"),
    [
        ("score", "raise", "RuntimeError in score() at layer 0: broken score"),
        ("score", "exit0", "SystemExit in score() at layer 0: exit code 0: a policy may not end the run"),
        ("score", "kbd", "KeyboardInterrupt in score() at layer 0: no Ctrl-C was pressed: a policy may not stop"),
        ("min_tokens", "raise", "RuntimeError in min_tokens(): broken min_tokens"),
        ("check_params", "raise", "RuntimeError in check_params(): broken check_params"),
        ("check_params", "exit0", "SystemExit in check_params(): exit code 0"),
        ("prepare", "raise", "RuntimeError in prepare(): broken prepare"),
        ("prepare", "kbd", "KeyboardInterrupt in prepare(): no Ctrl-C was pressed"),
        ("observation_window", "exit0", "SystemExit in observation_window(): exit code 0"),
    ],
)
def test_whatever_a_user_policy_raises_stops_the_run_with_2_naming_it(rogue, tmp_path, method, how, said):
    """Before: an exception in min_tokens, check_params or prepare was exit 3, "a bug in evalkit"; KeyboardInterrupt
    from score exit 1 (the gate's FAIL) with a traceback; SystemExit(0) from score exit 0 with no row written."""
    args = [*TINY, "task.depths=[0.5]", "policy=rogue", f"+policy.method={method}", f"+policy.how={how}"]
    result = cli(rogue, *args, run_dir=tmp_path / "run")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"evalkit: error: policy rogue (my_rogue.Rogue) raised {said}")
    )
    assert "Traceback" not in result.stderr and "bug in evalkit" not in result.stderr


def test_a_well_behaved_user_policy_runs_and_the_users_ctrl_c_stays_130(rogue, tmp_path):
    """The same class with no fault runs (exit 0, its rows written). Ctrl-C pressed twice while its score runs (two
    SIGINTs the process receives) is the user's stop: exit 130 with the command to resume, not the policy's fault."""
    fine = cli(rogue, *TINY, "task.depths=[0.5]", "policy=rogue", run_dir=tmp_path / "fine")
    assert fine.returncode == 0, fine.stderr[-2000:]
    assert {r["variant"] for r in rows(tmp_path / "fine")} == {"baseline", "rogue@0.25"}
    src, conf = rogue
    stopped = run_cli(
        *TINY, "task.depths=[0.5]", "policy=rogue", "+policy.method=score", "+policy.how=ctrl-c",
        f"hydra.searchpath=[file://{conf}]", f"hydra.run.dir={tmp_path / 'stopped'}", env={"PYTHONPATH": str(src)},
        process=True,
    )  # fmt: skip
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert "evalkit: to resume: python -m evalkit" in stopped.stderr and "policy rogue" not in stopped.stderr
