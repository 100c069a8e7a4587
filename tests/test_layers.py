"""The architecture as a test (docs/architecture.md): every import statement of evalkit/, policies/ and kernels/ is
walked, those inside functions included (a `TYPE_CHECKING` block, for annotations, excepted). There is no cycle, and
each layer imports only itself and the layers it sits on:

    command line (evalkit.cli, evalkit.lmeval.cli)
      -> run pipeline (evalkit.run, evalkit.lmeval, evalkit.backends)
        -> tasks -> KV storage (evalkit.kv) -> policies -> attention and kernels -> leaves
      -> verdict (evalkit.gate), report, planner: no torch, and nothing of the pipeline
    Hydra's overrides and config names (evalkit.cli.overrides, choices): no torch, shared by the planner
    leaves (errors, exits, sigint, units, fields, records, capacity, embedded): nothing of evalkit's

An import inside a function is allowed only where the module it imports is heavy and the caller's start-up must not
pay for it (the command line answers a typo before torch loads); it is never a way around a cycle, which this test
would see.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = {"evalkit": ROOT / "evalkit", "evalkit.policies": ROOT / "policies", "evalkit.kernels": ROOT / "kernels"}

# Layer of a module: the first prefix that matches (longest prefixes first).
LAYER_OF = [
    ("evalkit.lmeval.cli", "cli"),
    ("evalkit.lmeval.__main__", "cli"),
    ("evalkit.lmeval.registry", "tasks"),
    ("evalkit.__main__", "cli"),
    ("evalkit.cli.overrides", "hydra"),
    ("evalkit.cli.choices", "hydra"),
    ("evalkit.cli", "cli"),
    ("evalkit.run", "run"),
    ("evalkit.lmeval", "run"),
    ("evalkit.backends", "run"),
    ("evalkit.tasks", "tasks"),
    ("evalkit.attention", "attention"),
    ("evalkit.kv", "kv"),
    ("evalkit.policies", "policies"),
    ("evalkit.kernels", "attention"),
    ("evalkit.gate", "gate"),
    ("evalkit.report", "report"),
    ("evalkit.plan", "plan"),
    ("evalkit", "leaves"),
]
BELOW = {
    "leaves": set(),
    "attention": {"leaves"},
    "policies": {"attention", "leaves"},
    "kv": {"policies", "attention", "leaves"},
    "tasks": {"leaves"},
    "gate": {"leaves"},
    "report": {"gate", "leaves"},
    "hydra": {"leaves"},
    "plan": {"report", "gate", "hydra", "leaves"},
    "run": {"tasks", "kv", "policies", "attention", "gate", "plan", "leaves"},
}
BELOW["cli"] = set(BELOW) | {"run"}
TORCH_FREE = {"leaves", "hydra", "gate", "report", "plan"}
HEAVY = ("torch", "transformers", "triton")


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def layer(module: str) -> str:
    return next(name for prefix, name in LAYER_OF if module == prefix or module.startswith(prefix + "."))


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import statement outside TYPE_CHECKING blocks; an
    evalkit module by its own name, an external one by its top-level package."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    in_function = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for sub in ast.walk(node)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
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


def test_no_import_cycle():
    edges = {m: {t for t, _, _ in targets if t.startswith("evalkit")} for m, targets in graph().items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert cycles == []


def test_each_layer_imports_only_what_it_sits_on():
    wrong = [
        f"{m} ({layer(m)}) imports {t} ({layer(t)}), line {line}"
        for m, targets in graph().items()
        for t, line, _ in targets
        if t.startswith("evalkit") and layer(t) != layer(m) and layer(t) not in BELOW[layer(m)]
    ]
    assert wrong == []


def test_the_verdict_report_planner_and_leaves_never_import_torch():
    """Statically: no import of torch, transformers or triton anywhere in those layers, not even inside a function,
    except the planner reading a GGUF header or a Hub config through transformers (tests/test_report_page.py checks
    that a plan of a converted or local model, the report and the gate load neither)."""
    allowed = {("evalkit.plan.sources", "transformers"), ("evalkit.embedded", "transformers")}
    heavy = [
        f"{m}: {t}, line {line}"
        for m, targets in graph().items()
        for t, line, _ in targets
        if layer(m) in TORCH_FREE and t in HEAVY and (m, t) not in allowed
    ]
    assert heavy == []


def test_layers_are_named_for_every_module():
    """A new module lands in a layer by its package; this catches a module outside every layer's prefix."""
    unplaced = [m for m in modules() if layer(m) not in BELOW]
    assert unplaced == []


def test_function_level_imports_of_evalkit_modules_are_the_listed_lazy_ones():
    """Imports of evalkit modules inside functions: only to keep a command's start-up off torch, scipy, plotly or
    lm-eval. Each is listed here with its reason; a new one must argue its case the same way."""
    lazy = {
        ("evalkit.cli.main", "evalkit.cli.job"): "torch and transformers load only once the config is known good",
        ("evalkit.cli.main", "evalkit.cli.precheck"): "a typo is answered before the policies (torch) load",
        ("evalkit.cli.main", "evalkit.cli.sweep"): "the sweep merge (gate, report) only after a -m sweep",
        ("evalkit.cli.main", "evalkit.gate.command"): "the gate (scipy, statsmodels) only with gate=...",
        ("evalkit.cli.main", "evalkit.gate.outputs"): "the gate only with gate=...",
        ("evalkit.cli.main", "evalkit.gate.thresholds"): "the gate only with gate=...",
        ("evalkit.cli.main", "evalkit.report.wandb_log"): "W&B only with logger=wandb",
        ("evalkit.cli.sweep", "evalkit.gate.command"): "Hydra builds the callback for every run; it judges sweeps only",
        ("evalkit.cli.sweep", "evalkit.gate.outputs"): "as above",
        ("evalkit.cli.sweep", "evalkit.gate.thresholds"): "as above",
        ("evalkit.cli.sweep", "evalkit.report.build"): "as above (plotly, matplotlib)",
        ("evalkit.run.runner", "evalkit.lmeval.evaluate"): "lm-eval only for task=lm_eval",
        ("evalkit.kernels", "evalkit.kernels.quant"): "triton only where a kernel runs",
    }
    found = defaultdict(list)
    for m, targets in graph().items():
        for t, line, inside in targets:
            if inside and t.startswith("evalkit"):
                found[m, t].append(line)
    assert sorted(set(found) - set(lazy)) == []
