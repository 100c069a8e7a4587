"""fastkvzip: learned gates per layer score each token from the hidden state entering attention (Fast KVzip, kvpress's
FastKVzipPress): the gate against a plain loop, the sinks and the recent window first, KVzip's ranking, the gates
file read and refused, and end to end. The identity test and the cache invariants cover it with every policy in
conf/policy (tests/test_cache_invariants.py, gates trained here on the tiny model: tests/data/fastkvzip_tiny.pt);
kvpress's choices on the real model, given the same gates, in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.calibrate.fastkvzip import initial, initial_gates
from evalkit.errors import ConfigError
from evalkit.kv.cache import full_attention_layers
from evalkit.policies import LayerView
from evalkit.policies.fastkvzip import FastKVzip, gate_scores
from evalkit.policies.kvzap import HiddenStates
from tests.conftest import WEIGHTS_TINY, compressed, run_cli, tiny_row


def gate_by_hand(gate: dict, hidden: torch.Tensor) -> torch.Tensor:
    """(Hkv, T) for hidden (T, hidden): per token and KV head, the mean over the group's query heads g of
    1 / (1 + sum_s exp(q_g . c_s / 4 - q_g . k / 4 - b_g)), q and k RMS-normed 16-dim projections, written out."""
    n_kv, _, n_sink, d = gate["k_base"].shape
    group = gate["b"].shape[-1]
    wq, bq, wk = gate["q_proj.weight"], gate["q_proj.bias"], gate["k_proj.weight"]

    def norm(x, w):
        return x / math.sqrt(float((x * x).mean()) + 1e-6) * w

    out = torch.zeros(n_kv, hidden.shape[0])
    for t, x in enumerate(hidden):
        for h in range(n_kv):
            k = norm(wk[h * d : (h + 1) * d] @ x, gate["k_norm.weight"])
            total = 0.0
            for g in range(group):
                row = (h * group + g) * d
                q = norm(wq[row : row + d] @ x + bq[row : row + d], gate["q_norm.weight"])
                logit = float(q @ k) / math.sqrt(d) + float(gate["b"][h, 0, g])
                total += 1 / (
                    1 + sum(math.exp(float(q @ gate["k_base"][h, 0, s]) / math.sqrt(d) - logit) for s in range(n_sink))
                )
            out[h, t] = total / group
    return out


def test_the_gate_equals_a_plain_loop():
    gate = initial(n_kv=2, n_q=6, hidden=12, seed=3)
    gate["q_proj.bias"] = torch.randn(6 * 16, generator=torch.Generator().manual_seed(4))
    gate["b"] = torch.randn(2, 1, 3, generator=torch.Generator().manual_seed(5))
    hidden = torch.randn(1, 5, 12, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(gate_scores(gate, hidden)[0], gate_by_hand(gate, hidden[0]), rtol=1e-5, atol=1e-6)


def test_sinks_and_the_recent_window_score_one_above_every_gate():
    """100 tokens: the 4 sinks and the last int(100 x 0.02) = 2 score 1; every other below 1 (a gate's score is
    1 / (1 + a positive sum)); at 40,000 tokens the window would be window_size, not 2% of it."""
    pol = FastKVzip(weights_path=str(WEIGHTS_TINY["fastkvzip"]), budget=0.25)
    pol.gates = [initial(n_kv=1, n_q=2, hidden=8, seed=0)]
    hidden = torch.randn(1, 100, 8, generator=torch.Generator().manual_seed(0))
    keys = torch.zeros(1, 1, 100, 4)
    view = LayerView(0, 1, 100, keys, keys, torch.arange(100).view(1, 1, 100), {}, {HiddenStates(): hidden})
    scores = pol.score(view)[0, 0]
    assert (scores[:4] == 1).all() and (scores[-2:] == 1).all() and (scores[4:-2] < 1).all()
    assert pol.window(100) == 2 and pol.window(40_000) == 4096 and pol.window(10) == 1


def test_it_keeps_the_budget_over_all_layers_with_uneven_heads(tiny, ids):
    pol = FastKVzip(weights_path=str(WEIGHTS_TINY["fastkvzip"]), budget=0.25)
    _, cache = compressed(tiny.model, ids, pol)
    layers = full_attention_layers(cache)
    held = [cache.layers[i].tokens() for i in layers]  # (B, Hkv) each
    k = math.ceil(0.25 * cache.layers[layers[0]].seen)
    assert sum(int(h.sum()) for h in held) == k * held[0].shape[1] * len(layers)
    assert len({int(x) for h in held for x in h.flatten()}) > 1  # heads and layers keep different counts
    for i in layers:  # the sinks are always held
        assert (cache.layers[i].positions[..., :4] == torch.arange(4)).all()


def test_a_missing_or_foreign_gates_file_is_refused(tmp_path, tiny):
    with pytest.raises(ConfigError, match="fastkvzip needs its gates: give weights_path"):
        FastKVzip(budget=0.25).validate(None)
    bad = tmp_path / "bad.pt"
    bad.write_text("not a torch file")
    with pytest.raises(ConfigError, match="not a Fast KVzip gates file"):
        FastKVzip(budget=0.25, weights_path=str(bad)).prepare(tiny.model, None)
    cfg = tiny.model.config
    other = type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": cfg.num_hidden_layers + 1})
    foreign = initial_gates(other, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="they are another model's"):
        FastKVzip(budget=0.25, weights_path=str(foreign)).prepare(tiny.model, None)
    with pytest.raises(ConfigError, match="^window_ratio=1.5"):
        FastKVzip(budget=0.25, weights_path=str(foreign), window_ratio=1.5).validate(None)


def test_the_command_line_runs_it(tmp_path):
    weights = f"policy.weights_path={WEIGHTS_TINY['fastkvzip']}"
    row = tiny_row(tmp_path, "policy=fastkvzip", "policy.budget=0.5", weights)
    assert row["variant"] == "fastkvzip@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "fastkvzip needs its gates: give policy.weights_path=FILE"),
        (["policy.decode=true"], "fastkvzip compresses once, after the prompt: set policy.decode=false"),
        (["prefill=chunked"], "fastkvzip does not support a chunked prefill"),
    ],
)
def test_what_it_cannot_run_is_refused_in_one_line(tmp_path, args, message):
    weights = [] if not args else [f"policy.weights_path={WEIGHTS_TINY['fastkvzip']}"]
    result = run_cli("model=tiny-random", "policy=fastkvzip", *weights, *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
