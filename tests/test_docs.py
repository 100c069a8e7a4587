"""README.md is what a newcomer follows, so it is tested as code:

- every `python -m evalkit ...` command in its fenced blocks composes as `--cfg job` would (Hydra's composition of
  conf/config.yaml with the overrides, interpolations resolved), and then passes evalkit's own pre-run checks
  (`evalkit.cli.precheck`: keys, types, values, policies, tasks, variants), in-process; a `-m` sweep is
  expanded into every combination of its values and each combination is checked the same way;
- `python -m evalkit.gate`, `.report`, `.plan` and `.lmeval` commands: their options parse, and what they name
  exists (a gate config, a model config, an lm-eval task, a variant), without running the work (see each test);
- the files "Reading the results" says a run writes are the files a quick-start-shaped run writes on the tiny model
  (both ways: none missing, none unlisted), and its console prints bytes in MiB;
- the docs the README and the code cite exist, and no code or test cites the DESIGN.md that never existed.

Commands that name your own files (`task.path=my_data.jsonl`, a model folder, a Hub dataset) cannot find them here:
they must pass every check up to that one, and fail only on it, naming that placeholder (PLACEHOLDERS).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import initialize_config_module

from evalkit.cli.precheck import precheck
from evalkit.config.choices import check_choices, options
from evalkit.config.overrides import check_resolved, compose_job, parse
from evalkit.errors import ConfigError
from tests.conftest import ROOT, importable

README = (ROOT / "README.md").read_text(encoding="utf-8")
# Paths the README tells you to replace with your own: a check may fail on them only, and must name them.
PLACEHOLDERS = (
    "prompts.jsonl",
    "my_data.jsonl",
    "data/my-set",
    "ruler-4096",
    "/models/llama-3.1-8b-instruct",
    "/path/to/any/hf/model",
    "Xnhyacinth/LongBench",  # task=longbench's Hub dataset, not on this machine
    "simonjegou/ruler",  # task=ruler's
)
MISSING = re.compile(r"is not a file|is not a local folder or file|its config could not be read")


# --- the README's commands ---------------------------------------------------------------------------------------


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every ``` block."""
    return re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[list[str]]:
    """argv of every `python -m evalkit[.x] ...` command in a bash, sh, yaml or untagged block (continuation lines
    joined; a leading `run:` of a CI step and `VAR=value` environment prefixes dropped; `# comments` dropped)."""
    out = []
    for info, body in fenced_blocks(text):
        if info.strip() not in ("", "bash", "sh", "yaml"):
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            line = re.sub(r"^\s*(-\s*)?(run:\s*)?", "", line)
            line = re.sub(r"^([A-Z_]+=\S+\s+)+", "", line)
            if line.startswith("python -m evalkit"):
                out.append(shlex.split(line, comments=True)[2:])  # from the module name on
    return out


COMMANDS = commands(README)
BY_MODULE = {m: [c[1:] for c in COMMANDS if c[0] == m] for m in {c[0] for c in COMMANDS}}


def _id(argv: list[str]) -> str:
    return " ".join(argv)[:80]


def test_the_readme_commands_are_found():
    """The parser finds the README's commands (an empty list would pass every test below): the quick start's, one of
    each entry point, a sweep, and none with an unbalanced quote."""
    assert ["policy=h2o", "task=needle"] in BY_MODULE["evalkit"]
    assert {"evalkit", "evalkit.gate", "evalkit.report", "evalkit.plan", "evalkit.lmeval"} <= set(BY_MODULE)
    assert any("-m" in c for c in BY_MODULE["evalkit"])
    assert len(BY_MODULE["evalkit"]) >= 30


# --- python -m evalkit ... ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder holding the README's own policy example (Write a policy): my_policies.py and my_conf/policy/vnorm.yaml,
    written from the README's blocks, so the commands that use them run as a reader would run them."""
    return policy_example(tmp_path_factory.mktemp("readme"))


def policy_example(folder):
    """The README's policy example written into `folder`: my_policies.py and my_conf/policy/vnorm.yaml."""
    module = next(b for _, b in fenced_blocks(README) if b.startswith('"""my_policies.py'))
    yaml = next(b for info, b in fenced_blocks(README) if info == "yaml" and "my_policies.ValueNorm" in b)
    (folder / "my_policies.py").write_text(module)
    (folder / "my_conf" / "policy").mkdir(parents=True)
    (folder / "my_conf" / "policy" / "vnorm.yaml").write_text(yaml)
    return folder


def combinations(argv: list[str]) -> list[list[str]]:
    """The jobs a command runs: itself, or for `-m` every combination of its swept values (Hydra's basic sweeper)."""
    if "-m" not in argv and "--multirun" not in argv:
        return [argv]
    axes = []
    for o in parse([a for a in argv if not a.startswith("-")]):
        key = o.get_key_element()
        axes.append([f"{key}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line])
    return [list(job) for job in itertools.product(*axes)]


def test_a_sweep_is_expanded_into_every_combination():
    """The expansion above is the product of the values, not one value per key (which would leave combinations
    unchecked): 2 policies x 2 budgets are 4 jobs, each with the fixed overrides."""
    jobs = combinations(["-m", "policy=h2o,snapkv", "policy.budget=0.25,0.5", "task=needle"])
    assert sorted(map(tuple, jobs)) == sorted(
        (f"policy={p}", f"policy.budget={b}", "task=needle") for p in ("h2o", "snapkv") for b in ("0.25", "0.5")
    )


@pytest.mark.parametrize("argv", BY_MODULE["evalkit"], ids=_id)
def test_every_evalkit_command_composes_and_passes_the_checks(argv, workdir, monkeypatch):
    """Each job of the command composes as `--cfg job` shows it (a misspelt key, a value of the wrong type, an
    unresolved interpolation fail here), then passes the checks `python -m evalkit` runs before any model loads; a
    failure is allowed only on a placeholder path of the README, and must name it."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)  # fail at once on a Hub dataset, no retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(workdir)
    importable(monkeypatch, workdir, "my_policies")
    for job in combinations(argv):
        check_choices(job)
        with initialize_config_module(config_module="evalkit.conf", version_base="1.3"):
            check_resolved(compose_job(job))
        try:
            precheck(job)
        except ConfigError as err:
            assert MISSING.search(str(err)) and any(p in str(err) for p in PLACEHOLDERS), f"{job}: {err}"


def test_cfg_cannot_preview_a_sweep(monkeypatch, capsys):
    """The README says `--cfg` with `-m` is refused with one line and exit 2 (Sweeps, clusters and GPUs)."""
    from evalkit.cli import main as cli

    monkeypatch.setattr(sys, "argv", ["evalkit", "-m", "policy=h2o,snapkv", "--cfg", "job"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2
    assert "cannot go together" in capsys.readouterr().err


# --- python -m evalkit.gate / .report / .plan / .lmeval ------------------------------------------------------------


@pytest.mark.parametrize("argv", BY_MODULE["evalkit.gate"], ids=_id)
def test_gate_commands_parse(argv, monkeypatch, capsys):
    """`--plan` runs (it only computes); a command that judges runs gets its folders and thresholds as written, the
    judging itself replaced (the README's folders are examples): an unknown option or gate config exits 2 here."""
    from evalkit.cli import gate

    seen = {}

    class Passed:
        passed = True

    def judged(runs, thresholds, out=None, junit=None, summary=None):
        seen.update(runs=runs, thresholds=thresholds, out=out, junit=junit, summary=summary, wandb=False)
        return Passed()

    monkeypatch.setattr(gate, "gate", judged)
    monkeypatch.setattr(gate, "log_wandb", lambda runs, judged: seen.update(wandb=(runs, judged)))
    monkeypatch.setattr(gate, "print_verdict", lambda verdict: None)
    assert gate.main(argv) == 0, capsys.readouterr().err
    if "--plan" in argv:
        assert "74" in capsys.readouterr().out  # the lossless PASS at the default thresholds (README, the gate)
    else:
        valued = {"--gate", "--out", "--junit", "--summary"}  # options followed by their value
        values = {i + 1 for i, a in enumerate(argv) if a in valued}
        assert seen["runs"] == [Path(a) for i, a in enumerate(argv) if not a.startswith("-") and i not in values]
        if "--junit" in argv:
            assert seen["junit"] == Path(argv[argv.index("--junit") + 1])
        assert bool(seen["wandb"]) == ("--wandb" in argv)  # logged after the verdict, to the runs it judged
        if "--wandb" in argv:
            assert seen["wandb"] == (seen["runs"], seen["out"] or seen["runs"][0])


@pytest.mark.parametrize("argv", BY_MODULE["evalkit.report"], ids=_id)
def test_report_commands_parse(argv, monkeypatch, capsys):
    """The runs and --out reach the report as written (the report itself replaced: the folders are examples)."""
    from evalkit.report import __main__ as report

    seen = {}
    monkeypatch.setattr(report, "report", lambda runs, out, thresholds=None: seen.update(runs=runs, out=out) or [])
    assert report.main(argv) == 0, capsys.readouterr().err
    if "--out" in argv:
        assert seen["out"] == Path(argv[argv.index("--out") + 1])


@pytest.mark.parametrize("argv", BY_MODULE["evalkit.plan"], ids=_id)
def test_plan_commands_compose(argv):
    """conf/plan.yaml composes with the overrides and every plan.* setting is accepted (evalkit.plan.settings);
    nothing reads the model, so a Hub id or a path of yours does not need to exist here."""
    from evalkit.cli import plan as plan_cli

    settings = plan_cli.plan_settings(plan_cli.compose(argv))
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.startswith("plan.") and value.replace(".", "").isdigit():
            assert float(getattr(settings, key.removeprefix("plan."))) == float(value)


@functools.cache
def lm_eval_names() -> set[str]:
    """Every task, group and tag name in lm-eval's own full index (built once: it reads every task YAML)."""
    from lm_eval.tasks import TaskManager

    return set(TaskManager().all_tasks)


@pytest.mark.parametrize("argv", BY_MODULE["evalkit.lmeval"], ids=_id)
def test_lmeval_commands_parse(argv, monkeypatch):
    """lm-eval's own parser accepts the options; `--model_args` holds only evalkit's model arguments, a model config
    evalkit has and a variant evalkit parses; each task one evalkit bundles or one in lm-eval's registry (offline)."""
    import inspect

    from lm_eval.__main__ import HarnessCLI
    from lm_eval.utils import simple_parse_args_string
    from omegaconf import OmegaConf

    from evalkit.cli.config import variants
    from evalkit.cli.lmeval import CommandLineLM
    from evalkit.tasks.lmeval_index import task_dir

    monkeypatch.setattr(sys, "argv", ["lm-eval", *argv])
    args = HarnessCLI().parse_args()
    assert args.model == "evalkit"
    model_args = args.model_args if isinstance(args.model_args, dict) else simple_parse_args_string(args.model_args)
    assert set(model_args) <= set(inspect.signature(CommandLineLM.__init__).parameters) - {"self", "unknown"}
    assert model_args.get("model", "smollm2-135m") in options("model")
    (variant,) = variants(OmegaConf.create({"seed": 0, "variants": [model_args["variant"]]}))
    assert variant.name == model_args["variant"]
    bundled = {m.group(1) for p in task_dir().glob("*.yaml") for m in [re.search(r"^task: (\S+)", p.read_text(), re.M)]}
    tasks = args.tasks if isinstance(args.tasks, list) else args.tasks.split(",")
    assert tasks
    if not set(tasks) <= bundled:  # lm-eval's own tasks (RULER's niah_single_1): its registry, read offline
        assert set(tasks) - bundled <= lm_eval_names()


# --- what a run writes --------------------------------------------------------------------------------------------


def listed_files(text: str) -> dict[str, str]:
    """The run folder's entries in "Reading the results" (the tree under results/needle/...): name -> its note."""
    (tree,) = [b for info, b in fenced_blocks(text) if info == "text" and b.startswith("results/")]
    return dict(re.findall(r"[├└]── (\S+)\s+(.*)", tree))


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory):
    """The quick start's run (`policy=h2o task=needle`) on the tiny model, one short needle, with the gate and W&B
    (offline) on; and a task=lm_eval run, the other kind the README lists files for. Returns their folders and the
    first run's console."""
    tmp = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env |= {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    needle = [
        "policy=h2o",
        "task=needle",
        "model=tiny-random",
        "task.context_lengths=[256]",
        "task.depths=[0.5]",
        "task.max_new_tokens=4",
        "gate=default",
        "gate.min_baseline_accuracy=null",  # random weights: the baseline scores 0, which the gate refuses to judge
        "logger=wandb",
        "logger.mode=offline",  # never upload from a test, whatever key the machine has
        f"hydra.run.dir={tmp / 'needle'}",
    ]
    lm = ["model=tiny-random", "task=lm_eval", "task.limit=1", "variants=[snapkv@0.5]", f"hydra.run.dir={tmp / 'lm'}"]
    # the two runs at once, one thread each (CI's time budget): they write to different folders
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "evalkit", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for argv in (needle, lm)
    ]
    (out, err), (_, lm_err) = (p.communicate(timeout=600) for p in procs)
    # one sample is far from the 74 a PASS needs: INCONCLUSIVE, exit 2 (the verdict files are written all the same)
    assert procs[0].returncode == 2 and b"INCONCLUSIVE" in out, err.decode()[-2000:]
    assert procs[1].returncode == 0, lm_err.decode()[-2000:]
    return tmp / "needle", tmp / "lm", out.decode()


def test_every_file_the_readme_lists_is_written_and_none_is_unlisted(quick_start):
    """The list in "Reading the results" is the run folder as written: a file it names that no run writes, or a file
    a run writes that it does not name (the list once named three files of many), fails."""
    needle, lm, _ = quick_start
    listed = {name.rstrip("/") for name in listed_files(README)}
    written = {p.name for p in needle.iterdir()} | {p.name for p in lm.iterdir()}
    assert listed == written
    assert (needle / "report" / "report.md").is_file() and (needle / "report" / "report.html").is_file()
    assert list((needle / "wandb").glob("offline-run-*"))
    assert json.loads((needle / "verdict.json").read_text())["verdict"] == "INCONCLUSIVE"
    assert (needle / "report.md").read_text().startswith("# evalkit gate: INCONCLUSIVE")


def test_the_fields_the_readme_explains_are_in_the_records(quick_start):
    """Every record field "Reading the results" names (`kv_bytes_deployed`, `evidence_retained_per_layer`,
    `flip_causes`, ...) is a key of the quick-start run's rows or of its summary, and `verdict.json` holds
    `variants.<name>.flip_causes` as it says: a renamed or invented field fails."""
    needle, _, _ = quick_start
    section = README[README.index("## Reading the results") : README.index("## The validation gate")]
    prose = re.sub(r"^```.*?^```", "", section, flags=re.S | re.M)
    named = set(re.findall(r"`([a-z0-9]+(?:_[a-z0-9]+)+)`", prose)) | {"prediction", "answers", "cell", "flip"}
    rows = [json.loads(line) for line in (needle / "samples.jsonl").read_text().splitlines()]
    summary = json.loads((needle / "summary.json").read_text())
    known = {k for r in rows for k in r} | {k for s in summary.values() for k in s}
    assert len(named) >= 15 and named <= known, named - known
    verdict = json.loads((needle / "verdict.json").read_text())
    assert all("flip_causes" in v for v in verdict["variants"].values())


def test_the_console_prints_bytes_in_mib(quick_start):
    """The console's KV column is in MiB (2**20 bytes), as the README's output shows: the baseline's bytes in
    summary.json divided by 2**20, printed with the MiB label; never "MB"."""
    needle, _, console = quick_start
    summary = json.loads((needle / "summary.json").read_text())
    mib = summary["baseline"]["kv_bytes"] / 2**20
    (line,) = [ln for ln in console.splitlines() if ln.startswith("baseline ")]
    assert f"{mib:.2f} MiB" in line
    assert " MB" not in console


def test_byte_formatting_uses_binary_units():
    """17,971,200 bytes (H2O's cache on SmolLM2) are 17971200 / 1048576 = 17.139... MiB."""
    from evalkit.units import fmt_bytes

    assert fmt_bytes(17_971_200) == "17.14 MiB" == fmt_bytes(17_971_200, "MiB")
    assert fmt_bytes(3 * 2**30) == "3.00 GiB" and fmt_bytes(1536) == "1.50 KiB" and fmt_bytes(512) == "512 B"


# --- the docs that are cited --------------------------------------------------------------------------------------


def _sources() -> list[Path]:
    return [p for d in ("evalkit", "policies", "tests", "kernels", "benchmarks") for p in (ROOT / d).rglob("*.py")]


def test_cited_docs_exist_and_design_md_is_cited_nowhere():
    """Every docs/*.md that README, docs/ or a source file names exists; nothing cites the missing DESIGN.md."""
    texts = {p: p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *_sources()]}
    cited = {m for t in texts.values() for m in re.findall(r"docs/([\w-]+\.md)", t)}
    assert cited and all((ROOT / "docs" / name).is_file() for name in cited), cited
    assert [str(p) for p, t in texts.items() if "DESIGN.md" in t and p != Path(__file__)] == []


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    """Every relative link of the README leads to a file of the repository, and every #anchor to a heading."""
    anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", README, re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if target.startswith("http"):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert (ROOT / path).exists(), target
        else:
            assert anchor in anchors, target


def test_the_invariants_doc_names_real_tests():
    """docs/invariants.md sends the reader to tests by name: each must exist in tests/."""
    doc = (ROOT / "docs" / "invariants.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    names = set(re.findall(r"`(?:tests/[\w.]+::)?(test_\w+)`", doc))
    assert len(names) >= 10 and all(f"def {n}(" in tests for n in names), names - set(
        re.findall(r"def (test_\w+)", tests)
    )
