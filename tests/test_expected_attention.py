"""expected_attention against references derived apart from its code: hand-built layers of head_dim 2, whose
averaged RoPE rotation has a closed form, with the kept tokens worked out by hand (and what a departure from the
definition would keep instead); the whole score against plain numpy with the rotation from the geometric series; the
observer's pre-RoPE statistics against queries rebuilt from known pre-RoPE ones; and, on the tiny model, against a
plain recomputation from the attention modules' own q_proj and the model's rotary embedding (as kvpress computes it),
none of evalkit's helpers.

Hand-built layers: head_dim 2 and one RoPE frequency w = pi/2, so the rotation at position p is by p * 90 degrees.
After a 6-token prompt with n_future_positions = 2 the future positions are 6 and 7 (rotations by 540 and 630
degrees: (cos, sin) = (-1, 0) and (0, -1)), whose mean is c = -1/2, s = -1/2: R = [[c, -s], [s, c]] =
[[-1/2, 1/2], [-1/2, -1/2]], a rotation by 225 degrees times 1/sqrt(2). A query mean mu = (-2, 0) becomes
R mu = (1, 1).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evalkit.attention.observation import Attended, PrefillRecorder
from evalkit.engine.engine import prefill
from evalkit.errors import ConfigError
from evalkit.kv.cache import compress
from evalkit.kv.variant import Variant
from evalkit.policies import LayerView
from evalkit.policies.expected_attention import ExpectedAttention, QueryStats, Stats
from tests.conftest import CTX, compressed, policy

BUDGET = 24
W = math.pi / 2
# positions 0..5: position 0 is the one sink (n_sink=1); mean terms (R mu).k / sqrt(2) with R mu = (1, 1):
# k1 (2, 0): sqrt 2 = 1.414; k2 (0, 1): 0.707; k3 (-2, 0): -1.414; k4 (0, -1): -0.707; k5 (1.5, 1.5): 2.121
KEYS = [[5.0, 5.0], [2.0, 0.0], [0.0, 1.0], [-2.0, 0.0], [0.0, -1.0], [1.5, 1.5]]


def view(keys, mean, cov, seen=6, values=None, n_sink=1, inv_freq=W, scaling=1.0, positions=None) -> LayerView:
    """One layer, one KV head holding `keys` (T x 2) at `positions` (default seen - T .. seen - 1), with the query
    statistics from position n_sink given per query head: mean (Hq x 2), cov (Hq x 2 x 2)."""
    k = torch.tensor(keys, dtype=torch.float32)[None, None]
    t = k.shape[2]
    pos = torch.tensor(positions) if positions is not None else torch.arange(seen - t, seen)
    v = torch.tensor(values if values is not None else [[1.0, 0.0]] * t, dtype=torch.float32)[None, None]
    stats = Stats(
        torch.tensor(mean, dtype=torch.float32)[None],
        torch.tensor(cov, dtype=torch.float32)[None],
        torch.tensor([inv_freq]),
        float(torch.tensor(scaling)),
    )
    obs = {QueryStats(n_sink): stats}
    return LayerView(0, 1, seen, k, v, pos.view(1, 1, t), {}, obs)


def ea(**kw) -> ExpectedAttention:
    return ExpectedAttention(**{"budget": 3, "n_sink": 1, "n_future_positions": 2, **kw})


ZERO = [[[0.0, 0.0], [0.0, 0.0]]]


def test_the_query_mean_is_rotated_by_the_rope_averaged_over_the_future_positions_by_hand():
    """Keeping 3: the sink and the two largest (R mu).k, k5 (2.12) and k1 (1.41): positions 0 1 5. Averaging the
    rotation over positions 0 and 1 instead of the future ones (R mu = (-1, -1)) would keep k3 and k4 (0 3 4); the
    unrotated mean (-2, 0) would keep k3 first (0 3 ...)."""
    v = view(KEYS, [[-2.0, 0.0]], ZERO)
    assert ea(use_covariance=False, use_vnorm=False).select(v, 3).tolist() == [[[0, 1, 5]]]
    # the same statistics seen from a prompt of 4 tokens (future positions 4, 5: R = [[1/2, -1/2], [1/2, 1/2]],
    # R mu = (-1, -1)): the opposite keys win
    assert ea(use_covariance=False, use_vnorm=False).select(
        view(KEYS[:4], [[-2.0, 0.0]], ZERO, seen=4), 3
    ).tolist() == [[[0, 2, 3]]]


def test_the_value_norm_rescales_the_expected_attention_by_hand():
    """Same layer, values of norm 1 except k2's, 3: the softmax shares one normaliser, so compare numerators times
    ||v||: k5 e^2.121 = 8.34, k2 3 e^0.707 = 6.08, k1 e^1.414 = 4.11. Keeping 3: 0 2 5 (without the value norm,
    or with ||v|| ignored: 0 1 5)."""
    values = [[1.0, 0.0], [1.0, 0.0], [0.0, 3.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
    v = view(KEYS, [[-2.0, 0.0]], ZERO, values=values)
    assert ea(use_covariance=False).select(v, 3).tolist() == [[[0, 2, 5]]]
    assert ea(use_covariance=False, use_vnorm=False).select(v, 3).tolist() == [[[0, 1, 5]]]


@pytest.mark.parametrize(
    ("cov", "kept", "why"),
    [
        # Sigma = 8 I: R Sigma R^T = 8 R R^T = 4 I, k^T Sigma' k / (2 d) = |k|^2: k1 5.41, k3 -1.41 + 4 = 2.59,
        # k2 0.71 + 1 = 1.71, k5 2.12 + 4.5 = 6.62 -> k5 k1 k3 (the mean alone: k5 k1 k2)
        ([[8.0, 0.0], [0.0, 8.0]], [0, 1, 3, 5], "isotropic"),
        # Sigma = diag(8, 0): R Sigma R^T = 1/2 Rot(225) diag(8, 0) Rot(225)^T = 4 u u^T, u = (-1, -1)/sqrt 2, i.e.
        # [[2, 2], [2, 2]]: quadratic term (kx + ky)^2 / 2: k1 1.41 + 2 = 3.41, k3 -1.41 + 2 = 0.59,
        # k2 0.71 + 0.5 = 1.21, k5 2.12 + 4.5 = 6.62 -> k5 k1 k2. Sigma left unrotated would add 2 kx^2 and keep k3.
        ([[8.0, 0.0], [0.0, 0.0]], [0, 1, 2, 5], "rotated"),
    ],
)
def test_the_covariance_is_rotated_and_adds_half_its_quadratic_form_by_hand(cov, kept, why):
    v = view(KEYS, [[-2.0, 0.0]], [cov])
    assert ea(use_vnorm=False).select(v, 4).tolist() == [[kept]], why
    assert ea(use_vnorm=False, use_covariance=False).select(v, 4).tolist() == [[[0, 1, 2, 5]]]


def test_the_sinks_are_kept_and_left_out_of_each_heads_softmax_before_the_group_mean_by_hand():
    """Two query heads on one KV head, no rotation (w = 0: R = I), sink k0 = (4, 0), k1 = (1, 0), k2 = (0, 1).
    Head A, mu = (2 sqrt 2, 0): logits k1 2, k2 0 -> 0.881, 0.119. Head B, mu = (0, sqrt 2 / 2): k1 0, k2 0.5 ->
    0.378, 0.622. Mean: k1 0.629 > k2 0.371, keep 0 1. Were the sink (logit 8 in head A) in head A's softmax, head A
    would give k1 0.0025, k2 0.0003 and head B would decide: k2 (0 2)."""
    keys = [[4.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    v = view(keys, [[2 * math.sqrt(2), 0.0], [0.0, math.sqrt(2) / 2]], ZERO * 2, seen=3, inv_freq=0.0)
    pol = ea(budget=2, use_covariance=False, use_vnorm=False)
    scores = pol.score(v)[0, 0, 1:]
    torch.testing.assert_close(scores, torch.tensor([0.629, 0.371]), atol=1e-3, rtol=0)
    assert pol.select(v, 2).tolist() == [[[0, 1]]]
    # the sink scores lowest of all here, and is still kept: it is protected
    assert ExpectedAttention(budget=1, n_sink=1, use_vnorm=False).select(v, 1).tolist() == [[[0]]]


def test_the_score_equals_plain_numpy_with_the_rotation_from_the_geometric_series():
    """Random keys, values and statistics, 2 query heads on 1 KV head, head_dim 2, w = 0.3, a RoPE attention scaling
    of 1.5, 37 tokens seen and 512 future positions; 10 tokens held, the 4 sinks and positions 31..36. The mean
    rotation is sum_p e^{i p w} / n = e^{i 37 w} (1 - e^{i 512 w}) / (512 (1 - e^{i w})), times 1.5; the score is the
    formula written out in float64. Catches a wrong magnitude anywhere (1/sqrt(d), 1/(2d), the averaging, the
    scaling, the value norm) that a kept set may not show."""
    rng = np.random.default_rng(0)
    t, seen, n, w, a = 10, 37, 512, 0.3, 1.5
    keys, values = rng.normal(size=(t, 2)), rng.normal(size=(t, 2))
    mean = rng.normal(size=(2, 2))
    x = rng.normal(size=(2, 2, 2))
    cov = x @ x.transpose(0, 2, 1) / 2  # positive semi-definite
    z = a * np.exp(1j * seen * w) * (1 - np.exp(1j * n * w)) / (n * (1 - np.exp(1j * w)))
    rot = np.array([[z.real, -z.imag], [z.imag, z.real]])
    probs = []
    for h in range(2):
        mu, sig = rot @ mean[h], rot @ cov[h] @ rot.T
        logits = keys @ mu / math.sqrt(2) + np.einsum("ti,ij,tj->t", keys, sig, keys) / 4
        e = np.exp(logits[4:] - logits[4:].max())  # over the held tokens but the sinks
        probs.append(e / e.sum())
    want = ((probs[0] + probs[1]) / 2 + 0.0) * np.linalg.norm(values[4:], axis=1)  # epsilon 0
    positions = [0, 1, 2, 3, *range(31, 37)]
    v = view(keys.tolist(), mean.tolist(), cov.tolist(), seen, values.tolist(), 4, w, a, positions)
    got = ExpectedAttention(budget=5, n_future_positions=n).score(v)[0, 0, 4:]
    np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=1e-7)


class Rotary(torch.nn.Module):
    def __init__(self, inv_freq, scaling):
        super().__init__()
        self.inv_freq, self.attention_scaling = torch.tensor(inv_freq), scaling


def test_the_observer_recovers_the_pre_rope_mean_and_covariance_from_position_n_sink_on():
    """Known pre-RoPE queries q_p (head_dim 2) are rotated by p * 0.7 and scaled by 1.5, as a RoPE with attention
    scaling rotates them, for 9 positions; the observer must give back the mean and the covariance (divided by the
    count) of q_2 .. q_8 for query_stats=(2,), and of all nine for (0,)."""
    rng = np.random.default_rng(1)
    pre = rng.normal(size=(9, 2)) * [3.0, 0.5] + [1.0, -2.0]
    ang = np.arange(9) * 0.7
    post = 1.5 * np.stack(
        [pre[:, 0] * np.cos(ang) - pre[:, 1] * np.sin(ang), pre[:, 1] * np.cos(ang) + pre[:, 0] * np.sin(ang)], 1
    )
    query = torch.tensor(post, dtype=torch.float32)[None, None]  # (1, 1, 9, 2)
    model = torch.nn.Module()
    model.rotary_emb = Rotary([0.7], 1.5)
    obs = PrefillRecorder((QueryStats(0), QueryStats(2)), model)
    obs.record(0, object(), Attended(None, query, torch.zeros(1, 1, 9, 2), 1.0, 9))
    for s in (0, 2):
        q = pre[s:]
        mu = q.mean(0)
        np.testing.assert_allclose(obs.observations[0][QueryStats(s)].mean[0, 0].numpy(), mu, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            obs.observations[0][QueryStats(s)].cov[0, 0].numpy(), (q - mu).T @ (q - mu) / len(q), rtol=1e-5, atol=1e-5
        )


# -- the tiny model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(eager, ids):
    """From the eager model (no evalkit observer): per layer, the pre-RoPE queries (1, Hq, T, D) as kvpress takes
    them, q_proj of the attention module's input hidden states; and the keys and values of a plain prefill."""
    captured = {}

    def hook(module, args, kwargs):
        h = kwargs["hidden_states"]
        captured[module.layer_idx] = module.q_proj(h).view(*h.shape[:2], -1, module.head_dim).transpose(1, 2)

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in eager.model.layers]
    try:
        with torch.inference_mode():
            out = eager(input_ids=ids[:, :CTX], use_cache=True)
    finally:
        for h in handles:
            h.remove()
    layers = out.past_key_values.layers
    return captured, [layer.keys for layer in layers], [layer.values for layer in layers]


def test_observed_statistics_on_the_tiny_model_equal_those_of_the_pre_rope_queries(tiny, ids, plain):
    """The observer rotates evalkit's post-RoPE queries back; the reference is q_proj of the hidden states, the
    queries before RoPE, over positions 4..95 (the 4 sinks' left out). Catches a wrong rotation direction or half
    layout, a wrong position, or the sinks' queries counted."""
    queries, _, _ = plain
    _, obs = prefill(tiny.model, ids[:, :CTX], [policy("expected_attention", BUDGET)])
    for layer_idx, q in queries.items():
        q = q[0, :, 4:].double()  # (Hq, 92, D)
        mu = q.mean(dim=1)
        c = q - mu[:, None]
        torch.testing.assert_close(obs[layer_idx][QueryStats(4)].mean[0].double(), mu, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            obs[layer_idx][QueryStats(4)].cov[0].double(), c.transpose(-1, -2) @ c / 92, rtol=1e-4, atol=1e-5
        )


def test_on_the_tiny_model_it_keeps_the_top_set_of_a_plain_recomputation(tiny, eager, ids, plain):
    """kvpress's computation written out: R = mean over positions 96..607 of cos I + sin P from the model's own
    rotary embedding (P the rotate_half matrix), mu' = R mu, Sigma' = R Sigma R^T, exp-logits mu'.k / 4 +
    k^T Sigma' k / 32 (head_dim 16) softmaxed over positions 4..95 per query head, the 2 heads of each KV group
    averaged, times ||v||; the 4 sinks and the 20 best kept per KV head."""
    queries, keys, values = plain
    _, cache = compressed(tiny.model, ids, policy("expected_attention", BUDGET))
    d = 16
    with torch.inference_mode():
        cos, sin = eager.model.rotary_emb(torch.zeros(1), torch.arange(CTX, CTX + 512)[None])
    cos, sin = cos[0].double(), sin[0].double()  # (512, D)
    p = torch.zeros(d, d, dtype=torch.float64)
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    r = (cos[:, None, :] * torch.eye(d, dtype=torch.float64) + sin[:, None, :] * p).mean(dim=0)
    for layer_idx, layer in enumerate(cache.layers):
        q = queries[layer_idx][0, :, 4:].double()  # (4, 92, D)
        mu = q.mean(dim=1)
        sigma = (q - mu[:, None]).transpose(-1, -2) @ (q - mu[:, None]) / 92
        k = keys[layer_idx][0, :, 4:].double().repeat_interleave(2, dim=0)  # (4, 92, D)
        logits = (k @ (mu @ r.T)[:, :, None])[..., 0] / 4 + ((k @ (r @ sigma @ r.T)) * k).sum(-1) / 32
        score = logits.softmax(dim=-1).view(2, 2, -1).mean(dim=1) * values[layer_idx][0, :, 4:].double().norm(dim=-1)
        for h, held in enumerate(layer.positions[0].tolist()):
            want = {0, 1, 2, 3} | {int(i) + 4 for i in score[h].topk(BUDGET - 4).indices}
            assert set(held) == want, f"layer {layer_idx} head {h}"


def test_several_sink_counts_in_one_prefill_each_get_their_own_statistics(tiny, ids):
    """One prefill serving n_sink 4 and 8 records statistics from both positions; each policy keeps what it keeps
    after a prefill of its own."""
    a, b = policy("expected_attention", BUDGET), policy("expected_attention", BUDGET, n_sink=8)
    full, obs = prefill(tiny.model, ids[:, :CTX], [a, b])
    assert {QueryStats(4), QueryStats(8)} <= set(obs[0])
    for pol in (a, b):
        alone = compressed(tiny.model, ids, pol)[1]
        shared = compress(full, pol, obs)
        for x, y in zip(alone.layers, shared.layers, strict=True):
            assert torch.equal(x.positions, y.positions)
    assert not torch.equal(compress(full, a, obs).layers[0].positions, compress(full, b, obs).layers[0].positions)


# -- declarations and checks ------------------------------------------------------------------------------------


def test_it_declares_its_needs_and_compresses_once():
    pol = policy("expected_attention", 0.25)
    assert (pol.needs(), pol.observation_window()) == ((QueryStats(4),), 0)
    assert (pol.chunkable, pol.decodable, pol.decode) == (False, False, False)
    assert (pol.n_future_positions, pol.n_sink, pol.use_covariance, pol.use_vnorm, pol.epsilon) == (
        512,
        4,
        True,
        True,
        0.0,
    )  # kvpress 0.5.5 ExpectedAttentionPress's defaults
    pol.validate(128)
    assert pol.min_tokens() == 5
    with pytest.raises(ConfigError, match="compresses once"):
        policy("expected_attention", 0.25, decode=True).validate(None)
    with pytest.raises(ConfigError, match="does not support a chunked prefill"):
        Variant(pol, chunk=32).validate()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"n_sink": -1}, "n_sink=-1 is negative"),
        ({"n_future_positions": 0}, "n_future_positions=0"),
        ({"epsilon": -0.1}, "epsilon=-0.1 is negative"),
    ],
)
def test_parameters_out_of_range_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        policy("expected_attention", 0.25, **override).validate(None)
