"""SimLayerKV (policies/simlayerkv.py): a lazy layer keeps its first and most recent tokens, any other layer all.

The layer's laziness is checked by hand on a small layer and against transformers' eager attention matrices of the
tiny model (the last context query's weights, read from the model, not from evalkit's recording); what each layer
then holds against that reference; the identity test; one-line refusals. kvpress's choices on SmolLM2 are in
tests/test_peer_kvpress.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.attention.observation import Attended, WindowQueries
from evalkit.errors import ConfigError
from evalkit.kv.cache import held_per_layer, held_positions
from evalkit.policies import LayerView
from evalkit.policies.simlayerkv import SimLayerKV
from tests.conftest import CTX, compressed, run_cli


def test_laziness_and_the_kept_ends_by_hand():
    """One head, 6 keys along (1, 0) and (0, 1), the last query (0, ln 3) with scaling 1: exp scores 1 for the keys
    along (1, 0) and 3 for those along (0, 1). Keys 0, 3 and 5 are (0, 1): softmax 3/12 each, the others 1/12. With
    n_last 1, n_initial 1, n_recent 2 the share is key 0 (3/12) plus keys 3 and 4 (3/12 + 1/12), 7/12 = 0.583: lazy
    under 0.5, not under 0.6. A lazy layer keeps key 0 and the last n_recent - n_last = 1 key."""
    keys = torch.tensor([[[[0.0, 1], [1, 0], [1, 0], [0, 1], [1, 0], [0, 1]]]])
    q = torch.tensor([[[[0.0, math.log(3)]]]])
    window = WindowQueries(1).prefill(Attended(None, q, keys, scaling=1.0, seen=6))
    view = LayerView(0, 1, 6, keys, keys.clone(), torch.arange(6).expand(1, 1, 6), {}, {WindowQueries(1): window})
    pol = SimLayerKV(n_recent=2, n_initial=1, lazy_threshold=0.5)
    assert pol.laziness(view) == pytest.approx(7 / 12, abs=1e-6)
    assert pol.over(view, 6) and not SimLayerKV(n_recent=2, n_initial=1, lazy_threshold=0.6).over(view, 6)
    assert pol.select(view, 6).tolist() == [[[0, 5]]]
    # a context no longer than n_initial + n_recent + n_last is left whole, as kvpress leaves it
    assert not SimLayerKV(n_recent=4, n_initial=1, lazy_threshold=0.0).over(view, 6)


def eager_laziness(eager, ids, n_initial: int, n_recent: int) -> list[float]:
    """Per layer, from transformers' eager attention weights: the last context query's attention on the first
    `n_initial` keys and the `n_recent` keys before it, averaged over the query heads."""
    with torch.inference_mode():
        out = eager(ids[:, :CTX], output_attentions=True)
    shares = []
    for attn in out.attentions:  # (B, Hq, T, T)
        last = attn[0, :, -1, :-1].mean(dim=0)  # the last query, the keys before it
        shares.append(float(last[:n_initial].sum() + last[-n_recent:].sum()))
    return shares


def test_lazy_layers_are_the_eager_references_and_keep_their_ends(tiny, eager, ids):
    n_initial, n_recent = 4, 16
    shares = eager_laziness(eager, ids, n_initial, n_recent)
    ordered = sorted(shares)
    # the midpoint of the widest gap between two layers' shares
    gap, threshold = max((b - a, (a + b) / 2) for a, b in zip(ordered, ordered[1:], strict=False))
    assert gap > 1e-4, shares  # no layer within float rounding (1e-6) of the threshold
    pol = SimLayerKV(n_recent=n_recent, lazy_threshold=threshold)
    _, cache = compressed(tiny.model, ids, pol)
    lazy = [s > threshold for s in shares]
    assert any(lazy) and not all(lazy)
    ends = list(range(n_initial)) + list(range(CTX - n_recent + 1, CTX))
    assert held_per_layer(cache) == [len(ends) if z else CTX for z in lazy]
    for z, layer in zip(lazy, cache.layers, strict=True):
        for head in held_positions(layer)[0]:
            assert head.tolist() == (ends if z else list(range(CTX)))


def test_identity_keeps_every_token_and_the_full_cache_logits(tiny, ids):
    """lazy_threshold 1.0 (no layer is lazy), and a recent window as long as the context (nothing to evict): the
    full cache, so the same logits (tests/test_cache_invariants.py runs the decode for every policy)."""
    for pol in (SimLayerKV(n_recent=16, lazy_threshold=1.0), SimLayerKV(n_recent=CTX, lazy_threshold=0.0)):
        full, cache = compressed(tiny.model, ids, pol)
        assert held_per_layer(cache) == [CTX] * len(cache.layers)
        for a, b in zip(cache.layers, full.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_its_settings_are_checked():
    for kwargs, message in [
        ({"budget": 0.25}, "leave budget at 1.0"),
        ({"lazy_threshold": 1.5}, "a share of attention in [0, 1]"),
        ({"n_recent": 1}, "n_recent > n_last"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            SimLayerKV(**kwargs).validate(None)
    SimLayerKV().validate(2048)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy.budget=0.25"], "SimLayerKV keeps every token of a layer"),
        (["policy.decode=true"], "simlayerkv compresses once, after the prompt: set policy.decode=false"),
        (["prefill=chunked"], "simlayerkv does not support a chunked prefill"),
    ],
)
def test_what_it_cannot_run_is_refused_in_one_line(tmp_path, args, message):
    result = run_cli("model=tiny-random", "policy=simlayerkv", *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
