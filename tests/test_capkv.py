"""capkv (CAPKV, kvpress's CapPress) against a float64 reference written out per query head here: the averaged RoPE
rotation as a mean of rotation matrices, an explicit inverse of each capacity matrix, the leverage token by token;
the identity test and the cache invariants cover it with every policy in conf/policy, kvpress's choices on the real
model in tests/test_peer_kvpress.py."""

from __future__ import annotations

import math

import torch

from evalkit.policies import LayerView
from evalkit.policies.cap import CAPKV
from evalkit.policies.expected_attention import QueryStats, Stats
from tests.conftest import run_cli

INV_FREQ = torch.tensor([1.0, 0.3])  # a RoPE over 4 head dims


def mean_rotation(start: int, n: int) -> torch.Tensor:
    """(4, 4) float64: the mean over positions start .. start + n - 1 of cos(p f) I + sin(p f) J, J the matrix of
    transformers' rotate_half (x1, x2) -> (-x2, x1), each frequency f on its pair of dimensions (i, i + 2)."""
    total = torch.zeros(4, 4, dtype=torch.float64)
    for p in range(start, start + n):
        r = torch.zeros(4, 4, dtype=torch.float64)
        for i, f in enumerate(INV_FREQ.tolist()):
            c, s = math.cos(p * f), math.sin(p * f)
            r[i, i], r[i + 2, i + 2], r[i, i + 2], r[i + 2, i] = c, c, -s, s
        total += r
    return total / n


def reference(mean: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: int, sink: int) -> torch.Tensor:
    """(Hkv, T - sink) float64 CAPKV scores, one query head at a time (2 query heads per KV head)."""
    rot = mean_rotation(seen, 8)
    out = torch.zeros(keys.shape[0], keys.shape[1] - sink, dtype=torch.float64)
    for h in range(mean.shape[0]):
        g = h // 2
        anchor = rot @ mean[h].double()
        anchor = anchor / anchor.norm()
        k, v = keys[g, sink:].double(), values[g, sink:].double()
        cos = torch.stack([anchor @ (ki / ki.norm()) for ki in k])
        w = torch.exp(5.0 * cos - (5.0 * cos).max())
        a = torch.eye(4, dtype=torch.float64) + sum((w[i] + 1e-6) * torch.outer(v[i], v[i]) for i in range(len(v)))
        inv = torch.linalg.inv(a)
        out[g] += torch.stack([w[i] * (v[i] @ inv @ v[i]) for i in range(len(v))]) / 2
    return out


def test_capkv_scores_relevance_weighted_value_leverage_as_written_out():
    torch.manual_seed(0)
    t, sink = 24, 3
    keys, values = torch.randn(1, 2, t, 4), torch.randn(1, 2, t, 4) * torch.tensor([2.0, 1.0, 0.5, 0.2])
    mean = torch.randn(1, 4, 4)
    stats = Stats(mean, torch.zeros(1, 4, 4, 4), INV_FREQ, 1.0)
    pol = CAPKV(budget=10, n_sink=sink, n_future_positions=8)
    view = LayerView(0, 1, t, keys, values, torch.arange(t).expand(1, 2, t), {}, {QueryStats(sink): stats})
    got = pol.score(view)[0]
    want = reference(mean[0], keys[0], values[0], t, sink)
    torch.testing.assert_close(got[:, sink:].double(), want, rtol=1e-4, atol=1e-6)
    kept = pol.select(view, 10)[0]
    for g in range(2):  # the sinks, then the 7 best by the reference
        assert kept[g].tolist() == sorted([0, 1, 2, *(want[g].topk(7).indices + sink).tolist()])


def test_capkv_is_a_prefill_method_refused_in_one_line(tmp_path):
    assert CAPKV().needs() == (QueryStats(4),)
    for args, message in [
        (["policy=capkv", "prefill=chunked"], "capkv does not support a chunked prefill"),
        (["policy=capkv", "policy.tau=0"], "policy.tau=0"),
    ]:
        result = run_cli("model=tiny-random", *args, f"hydra.run.dir={tmp_path}")
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert message in result.stderr, result.stderr
