"""The architecture as a test (docs/architecture.md): the folders are the layers. Every import statement of evalkit/,
policies/ and kernels/ is walked, those inside functions and in `TYPE_CHECKING` blocks included, and each folder
imports only itself and the folders it sits on (issue 52's picture):

    evalkit/calibrate/        the learned methods' calibration tools (python -m evalkit.calibrate), on cli/
    evalkit/cli/              every command line, Hydra's config composed, the run spec built once
      evalkit/run/            one sample loop for every engine, resume, the writer
        evalkit/engine/       the HF engine: load, prefill once, compress, decode       } the engines: each turns a
        evalkit/backends/     llama.cpp and OpenAI-compatible servers (on engine/)      } sample into outcomes,
        evalkit/lmeval/       lm-eval's driver (on engine/)                              } never importing the run
          evalkit/tasks/  evalkit/kv/  policies/            samples; KV storage; the policies (kv/ never policies/)
            evalkit/contract/  evalkit/attention/  kernels/ the policy contract; attention observed; Triton kernels
      evalkit/gate/  evalkit/report/  evalkit/plan/   beside the run, reading records only: each on the leaves alone
      evalkit/config/         Hydra's config names, overrides and gate files, no torch: the command lines' alone
    leaves: the modules directly in evalkit/, evalkit/records/, evalkit/scoring/, evalkit/stats/: nothing above them

There is no exceptions list: no module sits outside its folder's layer. A module's own `__main__.py` is an entry
point (`python -m evalkit.X`), which may import the command line it starts. An import inside a function points down
like any other; only a command line or an entry point writes one, to keep its start-up off a heavy library (a typo
is answered before torch loads), and never inside the layers below, where it could only hide a cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = {"evalkit": ROOT / "evalkit", "evalkit.policies": ROOT / "policies", "evalkit.kernels": ROOT / "kernels"}

LEAVES = "leaves"
LEAF_PACKAGES = ("records", "scoring", "stats")  # folders of leaves: they import only leaves
ENTRY = "entry points"
# Each folder and the folders it may import (besides itself and the leaves).
BOTTOM = {"evalkit.contract", "evalkit.attention", "evalkit.kernels"}
MIDDLE = {"evalkit.tasks", "evalkit.kv", "evalkit.policies"}
SITS_ON = {
    "evalkit.kernels": set(),
    "evalkit.attention": {"evalkit.kernels"},
    "evalkit.contract": {"evalkit.attention", "evalkit.kernels"},
    "evalkit.tasks": set(),
    "evalkit.kv": BOTTOM,
    "evalkit.policies": BOTTOM,
    "evalkit.engine": MIDDLE | BOTTOM,
    "evalkit.backends": {"evalkit.engine"} | MIDDLE | BOTTOM,
    "evalkit.lmeval": {"evalkit.engine"} | MIDDLE | BOTTOM,
    "evalkit.run": {"evalkit.engine", "evalkit.backends", "evalkit.lmeval"} | MIDDLE | BOTTOM,
    "evalkit.gate": set(),  # beside the run, reading records only
    "evalkit.report": set(),
    "evalkit.plan": set(),
    "evalkit.config": set(),
}
SITS_ON["evalkit.cli"] = {"evalkit.run", "evalkit.config", "evalkit.gate", "evalkit.report", "evalkit.plan"} | SITS_ON[
    "evalkit.run"
]
# the learned methods' calibration tools (python -m evalkit.calibrate): a command package on top, beside the run's
SITS_ON["evalkit.calibrate"] = {"evalkit.cli"} | SITS_ON["evalkit.cli"]
TORCH_FREE = {LEAVES, "evalkit.config", "evalkit.gate", "evalkit.report", "evalkit.plan"}
HEAVY = ("torch", "transformers", "triton")


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def folder(module: str) -> str:
    """The layer of a module: its folder (evalkit.X for evalkit/X/...); the leaves for the modules directly in
    evalkit/ and for the leaf packages; the entry points for the __main__ modules."""
    if module.endswith("__main__"):
        return ENTRY
    parts = module.split(".")
    if parts[:2] in (["evalkit", "policies"], ["evalkit", "kernels"]):
        return ".".join(parts[:2])
    is_package = (ROOT / "evalkit" / parts[1]).is_dir() if len(parts) > 1 else False
    if len(parts) == 1 or not is_package or parts[1] in LEAF_PACKAGES:
        return LEAVES
    return ".".join(parts[:2])


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import statement, those in TYPE_CHECKING blocks too; an
    evalkit module by its own name, an external one by its top-level package."""
    tree = ast.parse(path.read_text())
    in_function = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for sub in ast.walk(node)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            # `from evalkit.cli import sweep` imports the module sweep; `from evalkit.x import name`, module x
            names = submodules if len(submodules) == len(node.names) else [base, *submodules]
        for name in names:
            target = name
            while target and target not in known and target.startswith("evalkit"):
                target = target.rpartition(".")[0]
            if target and target != module:
                out.append(
                    (
                        target if target.startswith("evalkit") else target.split(".")[0],
                        node.lineno,
                        id(node) in in_function,
                    )
                )
    return out


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def evalkit_edges() -> list[tuple[str, str, int, bool]]:
    return [(m, t, line, inside) for m, ts in graph().items() for t, line, inside in ts if t.startswith("evalkit")]


def test_no_module_cycle():
    edges = defaultdict(set)
    for m, t, _, _ in evalkit_edges():
        edges[m].add(t)
    assert cycles(edges) == []


def test_no_folder_cycle():
    edges = defaultdict(set)
    for m, t, _, _ in evalkit_edges():
        if folder(m) != folder(t):
            edges[folder(m)].add(folder(t))
    assert cycles(edges) == []


def test_the_sits_on_table_is_acyclic_and_names_every_folder():
    """The table itself is a layering (no folder sits on one that sits on it), and every folder of the tree has a
    row: a new folder must be placed before it can import anything."""
    assert cycles({k: set(v) for k, v in SITS_ON.items()}) == []
    folders = {folder(m) for m in modules()} - {LEAVES, ENTRY}
    assert sorted(folders - set(SITS_ON)) == []


def test_each_folder_imports_only_what_it_sits_on():
    wrong = [
        f"{m} ({folder(m)}) imports {t} ({folder(t)}), line {line}"
        for m, t, line, _ in evalkit_edges()
        if folder(m) not in (folder(t), ENTRY, LEAVES) and folder(t) != LEAVES and folder(t) not in SITS_ON[folder(m)]
    ]
    assert wrong == []


def test_leaves_import_only_leaves():
    wrong = [f"{m} imports {t}, line {line}" for m, t, line, _ in evalkit_edges() if folder(m) == LEAVES != folder(t)]
    assert wrong == []


def test_imports_inside_functions_only_in_command_lines():
    """A function-level import of an evalkit module keeps a command's start-up light; below the command lines it
    would only hide a cycle, so there is none."""
    top = {"evalkit.cli", "evalkit.calibrate", ENTRY, "evalkit.gate", "evalkit.report", "evalkit.plan"}
    wrong = [
        f"{m}: import {t} inside a function, line {line}"
        for m, t, line, inside in evalkit_edges()
        if inside and folder(m) not in top and folder(m) != folder(t)
    ]
    assert wrong == []


def test_the_verdict_report_planner_and_leaves_never_import_torch():
    """Statically: no import of torch, transformers or triton anywhere in those layers, not even inside a function,
    except the planner reading a GGUF header or a Hub config through transformers (tests/test_report_page.py checks
    that a plan of a converted or local model, the report and the gate load neither)."""
    allowed = {("evalkit.sources", "transformers"), ("evalkit.embedded", "transformers")}
    heavy = [
        f"{m}: {t}, line {line}"
        for m, targets in graph().items()
        for t, line, _ in targets
        if folder(m) in TORCH_FREE and t in HEAVY and (m, t) not in allowed
    ]
    assert heavy == []


def test_nothing_of_the_pipeline_reads_hydra_config():
    """The run spec is built once in evalkit/cli/; the pipeline below it (the run, the engines, tasks, storage,
    policies, attention, kernels, the report and the leaves) takes it, not a DictConfig. The planner composes its own
    config as a command line does, the calibration tools read conf/model as the command lines do, and the gate reads
    a thresholds YAML with its `${...}` interpolations."""
    above = {"evalkit.cli", "evalkit.calibrate", "evalkit.config", "evalkit.plan", "evalkit.gate", ENTRY}
    found = [
        f"{m}: {t}, line {line}"
        for m, targets in graph().items()
        for t, line, _ in targets
        if t in ("omegaconf", "hydra") and folder(m) not in above
    ]
    assert found == []
