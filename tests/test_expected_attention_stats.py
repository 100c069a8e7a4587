"""expected_attention_stats (kvpress's ExpectedAttentionStatsPress): the statistics computed here against the queries
captured from the model by hand, the policy given a prompt's own statistics against Expected Attention on that prompt,
end to end from a file computed here, and one-line refusals; kvpress's choices with the same SmolLM2 file in
tests/test_peer_kvpress.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from evalkit.calibrate.ea_stats import statistics
from evalkit.engine.engine import prefill
from evalkit.kv.cache import compress, held_positions
from evalkit.policies.expected_attention import ExpectedAttention, QueryStats
from evalkit.policies.expected_attention_stats import ExpectedAttentionStats
from tests.conftest import WEIGHTS_TINY, run_cli, tiny_row


def captured_queries(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, (Hq, T, D) pre-RoPE queries: the q_proj outputs of a Llama (no query norm), by a forward hook."""
    out = []
    layers = model.model.layers
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, o: out.append(o)) for layer in layers]
    try:
        with torch.inference_mode():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    hq = model.config.num_attention_heads
    return [o[0].view(o.shape[1], hq, -1).transpose(0, 1) for o in out]


def test_pooled_statistics_are_those_of_all_the_queries_after_each_prompts_sinks(tiny):
    """Two prompts of 40 and 57 tokens, 3 sinks: the mean and covariance / (N - 1) of the 37 + 54 queries together."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (1, n), generator=g) for n in (40, 57)]
    mean, cov = statistics(tiny.model, prompts, n_sink=3)
    for layer in range(3):
        q = torch.cat([captured_queries(tiny.model, p)[layer][:, 3:] for p in prompts], dim=1).double()  # (Hq, N, D)
        want_mean = q.mean(dim=1)
        centred = q - want_mean[:, None]
        want_cov = centred.transpose(-1, -2) @ centred / (q.shape[1] - 1)
        torch.testing.assert_close(mean[layer].double(), want_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cov[layer].double(), want_cov, rtol=1e-4, atol=1e-5)


def test_given_a_prompts_own_statistics_it_keeps_what_expected_attention_keeps(tiny, tmp_path):
    """The file holds the prompt's statistics as Expected Attention estimates them (covariance / count): the same
    choice at every layer; another prompt's statistics choose otherwise."""
    g = torch.Generator().manual_seed(2)
    ids, other = torch.randint(3, 200, (1, 80), generator=g), torch.randint(3, 200, (1, 80), generator=g)
    own = ExpectedAttention(budget=20, n_future_positions=16)

    def save(prompt, folder):
        _, obs = prefill(tiny.model, prompt, [own])
        stats = [obs[i][QueryStats(4)] for i in range(3)]
        folder.mkdir()
        means, covs = torch.stack([s.mean[0] for s in stats]), torch.stack([s.cov[0] for s in stats])
        save_file({"query_mean": means, "query_cov": covs}, str(folder / "model.safetensors"))

    save(ids, tmp_path / "own")
    save(other, tmp_path / "other")
    full, obs = prefill(tiny.model, ids, [own])
    want = [held_positions(layer) for layer in compress(full, own, obs).layers]
    for folder, same in (("own", True), ("other", False)):
        pol = ExpectedAttentionStats(budget=20, n_future_positions=16, weights_path=str(tmp_path / folder))
        assert pol.needs() == () and pol.prepare(tiny.model, None)["sha256"]
        got = [held_positions(layer) for layer in compress(full, pol, {}).layers]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) is same


def test_statistics_computed_here_run_from_the_command_line(tmp_path):
    stats = f"policy.weights_path={WEIGHTS_TINY['expected_attention_stats']}"  # evalkit.calibrate ea_stats, tiny model
    row = tiny_row(tmp_path, "policy=expected_attention_stats", "policy.budget=0.5", stats)
    assert row["variant"] == "expected_attention_stats@0.5" and row["kv_bytes"] < row["kv_bytes_baseline"]
    prepared = json.loads((tmp_path / "run.json").read_text())["prepared"]["expected_attention_stats@0.5"]
    assert prepared["weights_path"].endswith("ea_stats_tiny/model.safetensors") and len(prepared["sha256"]) == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "expected_attention_stats needs its query statistics: give policy.weights_path=DIR"),
        (["policy.weights_path=tests/data/ea_stats_smollm2"], "statistics of shape (30, 9, 64), the model needs"),
        (["policy.weights_path=tests/data/qfilter_tiny"], "not an Expected Attention statistics file"),
    ],
)
def test_missing_or_foreign_statistics_are_refused_in_one_line(tmp_path, args, message):
    result = run_cli("model=tiny-random", "policy=expected_attention_stats", *args, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr, result.stderr
