"""Expected Attention from precomputed query statistics: the Gaussian of future queries read from a file, not
estimated from the prompt.

Devoto et al. 2025 (arXiv:2510.00636), as kvpress's ExpectedAttentionStatsPress: the mean and covariance of each
layer's pre-RoPE queries (all query heads), computed once over a calibration corpus, stand for the prompt's own in
policies/expected_attention.py; everything after (the averaged RoPE rotation, the expected attention, the value norm,
the sinks) is Expected Attention's. The prefill records nothing for it.

evalkit never reaches the Hub at run time: the statistics come from `policy.weights_path`, in the format kvpress's
ExpectedAttentionStats saves (`model.safetensors` holding `query_mean` (layers, query heads, head dim) and
`query_cov` (layers, query heads, head dim, head dim), in a folder, or that file itself). On a connected machine:

    huggingface-cli download alessiodevoto/exp_att_stats_<model>_kmfoda_booksum_100_1000_4 --local-dir DIR

or compute them here from the model's own queries (`python -m evalkit.calibrate ea_stats`). The file's path and SHA-256
are recorded in run.json under `prepared`.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalkit.errors import ParamError
from evalkit.policies import LayerView
from evalkit.policies.expected_attention import ExpectedAttention, Stats, rope
from evalkit.policies.weights import check_shape, head_dim, read_tensors, recorded, weights_file

FETCH = (
    "huggingface-cli download alessiodevoto/exp_att_stats_<model>_kmfoda_booksum_100_1000_4 --local-dir DIR, or "
    "python -m evalkit.calibrate ea_stats"
)


@dataclass(kw_only=True)
class ExpectedAttentionStats(ExpectedAttention):
    """Expected Attention with the query statistics of `weights_path`, read at prepare."""

    name: str = "expected_attention_stats"
    weights_path: str | None = None

    def needs(self) -> tuple:
        return ()  # the statistics are the file's

    def prepare(self, model, probes) -> dict:
        what = "an Expected Attention statistics file"
        tensors = read_tensors(self.weights_path, ("query_mean", "query_cov"), what, FETCH)
        mean, cov = tensors["query_mean"], tensors["query_cov"]
        cfg = model.config.get_text_config()
        want = (cfg.num_hidden_layers, cfg.num_attention_heads, head_dim(cfg))
        check_shape(self.weights_path, "statistics", mean.shape, want, "layers, query heads, head dim", FETCH)
        check_shape(self.weights_path, "covariances", cov.shape, (*want, want[-1]), "... head dim, head dim", FETCH)
        inv_freq, scaling = rope(model)
        self.stats = (mean.to(model.device).float(), cov.to(model.device).float(), inv_freq, float(scaling))
        return recorded(weights_file(self.weights_path))

    def statistics(self, view: LayerView) -> Stats:
        if not hasattr(self, "stats"):
            raise ValueError(f"{self.name}: the statistics were not read (prepare() was not called)")
        mean, cov, inv_freq, scaling = self.stats
        return Stats(mean[view.layer_idx][None], cov[view.layer_idx][None], inv_freq.float(), scaling)

    def check_params(self) -> None:
        super().check_params()
        if self.weights_path is None:
            raise ParamError(
                {"weights_path": None},
                f"{self.name} needs its query statistics: give $weights_path=DIR ({FETCH})",
                unset=True,
            )
        weights_file(self.weights_path)
