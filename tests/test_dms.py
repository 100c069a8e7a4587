"""DMS as kvpress's DMSPress runs it (policies/dms.py): the tokens an inner scorer puts below a threshold go, the last
`window` stay. By hand on a small layer, against a plain rule over the reference scores on the tiny model (kvzap's
surrogates on transformers' own hidden states), the identity, one-line refusals; kvpress's choices on SmolLM2 are in
tests/test_peer_kvpress.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from evalkit.attention.observation import Observation
from evalkit.errors import ConfigError
from evalkit.kv.cache import held_per_layer, held_positions
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.dms import DMS
from evalkit.policies.kvzap import KVzap
from tests.conftest import CTX, WEIGHTS_TINY, attention_inputs_by_hand, compressed, run_cli


@dataclass(kw_only=True)
class Given(KVPolicy):
    """A scorer whose scores are given (the layer's observation), for the hand-worked case."""

    name: str = "given"

    def score(self, view: LayerView) -> torch.Tensor:
        return view.observed(SCORES)


SCORES = Observation()


def test_below_the_threshold_goes_except_the_window_by_hand():
    """Two heads, 6 tokens, window 2, threshold 0.5. Head 0 scores 0.9 0.1 0.5 0.2 0.0 0.0: keeps 0 and 2 (0.5 is not
    below) and the window 4, 5. Head 1 scores 0.1 0.2 0.3 0.4 0.9 0.9: none before the window, so 4 and 5, padded.
    With no window, head 0 loses 4 and 5 (scores 0) and head 1 keeps them on their scores."""
    scores = torch.tensor([[[0.9, 0.1, 0.5, 0.2, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.9, 0.9]]])
    keys = torch.zeros(1, 2, 6, 4)
    view = LayerView(0, 1, 6, keys, keys, torch.arange(6).expand(1, 2, 6), {}, {SCORES: scores})
    pol = DMS(inner=Given(), threshold=0.5, window=2)
    assert pol.over(view, 6)
    assert pol.select(view, 6).tolist() == [[[0, 2, 4, 5], [4, 5, -1, -1]]]
    assert DMS(inner=Given(), threshold=0.5, window=0).select(view, 6).tolist() == [[[0, 2], [4, 5]]]
    assert not DMS(inner=Given(), threshold=0.5, window=6).over(view, 6)  # nothing before the window


def test_on_the_model_each_head_keeps_what_a_plain_rule_keeps_over_the_reference_scores(tiny, ids):
    window, threshold = 16, -9.0
    pol = DMS(inner=KVzap(weights_path=str(WEIGHTS_TINY["kvzap"])), threshold=threshold, window=window)
    _, cache = compressed(tiny.model, ids, pol)
    for i, hidden in enumerate(attention_inputs_by_hand(tiny.model, ids[:, :CTX])):
        scores = pol.inner.surrogates[i](hidden).transpose(1, 2)[0]  # (Hkv, T)
        for h, held in enumerate(held_positions(cache.layers[i])[0]):
            want = [p for p in range(CTX) if p >= CTX - window or scores[h, p] >= threshold]
            assert sorted(p for p in held.tolist() if p >= 0) == want
    assert min(held_per_layer(cache)) < CTX - window  # some evicted ...
    assert max(held_per_layer(cache)) > window  # ... and some kept before the window


def test_no_threshold_to_fall_below_is_the_full_cache(tiny, ids):
    pol = DMS(inner=KVzap(weights_path=str(WEIGHTS_TINY["kvzap"])), threshold=float("-inf"), window=16)
    full, cache = compressed(tiny.model, ids, pol)
    assert held_per_layer(cache) == [CTX] * len(cache.layers)
    for a, b in zip(cache.layers, full.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_its_settings_are_checked():
    inner = KVzap(weights_path=str(WEIGHTS_TINY["kvzap"]))
    for kwargs, message in [
        ({"threshold": -9.0, "budget": 0.5}, "leave budget at 1.0"),
        ({}, "dms needs threshold"),
        ({"threshold": -9.0, "window": -1}, "^window=-1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DMS(inner=inner, **kwargs).validate(None)
    with pytest.raises(ConfigError, match="kvzap needs its surrogate models: give inner.weights_path="):
        DMS(inner=KVzap(), threshold=-9.0).validate(None)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy.threshold=-9"], "kvzap needs its surrogate models: give policy.inner.weights_path=DIR"),
        ([f"policy.inner.weights_path={WEIGHTS_TINY['kvzap']}"], "dms needs policy.threshold"),
        (
            ["policy.threshold=-9", f"policy.inner.weights_path={WEIGHTS_TINY['kvzap']}", "prefill=chunked"],
            "does not support a chunked prefill",
        ),  # fmt: skip
    ],
)
def test_what_it_cannot_run_is_refused_in_one_line(tmp_path, args, message):
    result = run_cli("model=tiny-random", "policy=dms", *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
