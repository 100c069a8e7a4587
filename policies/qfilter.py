"""Q-Filters: keep the keys a learned direction per KV head says the queries will attend to.

Godey et al. 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression" (arXiv:2503.02812), as
kvpress's QFilterPress scores: a token's score is -<f, k>, f the filter of its layer and KV head and k its key as the
cache holds it (post-RoPE). The filters are learned per model: the paper takes, per head, the first right singular
vector of the queries, signed so that the queries' mean projection on it is negative (then a key far along f gets
little attention, and -<f, k> ranks it low).

evalkit never reaches the Hub at run time: the filters come from a local file, `policy.weights_path`, in the format
kvpress's QFilters saves (`model.safetensors` holding `q_filters`, (layers, KV heads, head dim), in a folder, or that
file itself). On a connected machine:

    huggingface-cli download nthngdy/<model name>_qfilt --local-dir qfilters/<model name>

or calibrate them here from the model's own queries (`python -m evalkit.calibrate qfilter`). The file's path and SHA-256
are recorded in run.json under `prepared`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.weights import check_shape, head_dim, read_tensors, recorded, weights_file

FETCH = "huggingface-cli download nthngdy/<model>_qfilt --local-dir DIR, or python -m evalkit.calibrate qfilter"


@dataclass(kw_only=True)
class QFilter(KVPolicy):
    """Per KV head: top-k by -<filter, key>, the filters read from `weights_path` at prepare."""

    name: str = "qfilter"
    weights_path: str | None = None
    decode: bool = False  # kvpress's QFilterPress scores the prompt; its scores need only the keys (decode=true works)

    def prepare(self, model, probes) -> dict:
        filters = read_tensors(self.weights_path, ("q_filters",), "a Q-Filters file", FETCH)["q_filters"]
        cfg = model.config.get_text_config()
        want = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg))
        check_shape(self.weights_path, "filters", filters.shape, want, "layers, KV heads, head dim", FETCH)
        self.filters = filters.to(model.device)  # not a field: not recorded, not compared
        return recorded(weights_file(self.weights_path))

    def score(self, view: LayerView) -> Tensor:
        if not hasattr(self, "filters"):
            raise ValueError(f"{self.name}: the filters were not read (prepare() was not called)")
        f = self.filters[view.layer_idx].float()  # (Hkv, D)
        return -(view.keys.float() * f[None, :, None, :]).sum(dim=-1)

    def check_params(self) -> None:
        if self.weights_path is None:
            raise ParamError(
                {"weights_path": None}, f"qfilter needs its filters: give $weights_path=DIR ({FETCH})", unset=True
            )
        weights_file(self.weights_path)
