"""Fast KVzip: small learned gates per layer predict KVzip's scores from the hidden states entering attention.

Kim, Han and Yun 2026, "Fast KVzip" (arXiv:2601.17668), as kvpress's FastKVzipPress scores: per layer, a gate
projects each token's hidden state (after the input norm) to one 16-dim key per KV head and one 16-dim query per query
head of the group (each RMS-normed), and gives the token 1 / (1 + sum_s exp(q.c_s / 4 - (q.k / 4 + b))) averaged over
the group, c_s the gate's 16 learned sink keys: a fast stand-in for KVzip's reconstruction pass. The first `n_sink`
tokens and the last `window_ratio` of the context (`window_size` tokens from 32,000 on) score 1, above any gate's
score; then the highest scores are kept over all layers and KV heads together, as KVzip ranks (`layerwise` per layer).

evalkit never reaches the Hub at run time: the gates come from a local file, `policy.weights_path`, in the format
the authors publish (a torch file holding {"module": [one state dict per layer]}: q_proj.weight and .bias,
k_proj.weight, q_norm.weight, k_norm.weight, k_base, b). On a connected machine:

    huggingface-cli download Jang-Hyun/Fast-KVzip <model name>/q<group>_dim16_sink16.pt --local-dir fastkvzip

or train a stand-in here (`python -m evalkit.calibrate fastkvzip`). The file's path and SHA-256 are recorded in
run.json. The hidden states are read in a forward of their own (KVzap's `HiddenStates`), as for KVzap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView
from evalkit.policies.kvzap import HiddenStates, context_hidden
from evalkit.policies.kvzip import RankedTogether
from evalkit.policies.weights import check_shape, recorded, weights_file

FETCH = (
    "huggingface-cli download Jang-Hyun/Fast-KVzip <model>/q<group>_dim16_sink16.pt, or "
    "python -m evalkit.calibrate fastkvzip"
)
PARTS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b")
EPS = 1e-6  # the gates' RMS norms (Qwen3RMSNorm's default)
LONG = 32_000  # from this many context tokens on, the protected window is `window_size` tokens, not a share


def read_gates(path: str, config) -> list[dict[str, Tensor]]:
    """Per layer, the gate's tensors from the torch file `path`, checked against the model's `config`; a ConfigError
    if it is not such a file or is another model's. Read with weights_only (no code runs), allowing the numpy arrays
    the published files hold."""
    allowed = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.Float64DType, np.dtypes.Float32DType]
    try:
        with torch.serialization.safe_globals(allowed):
            gates = torch.load(weights_file(path), map_location="cpu", weights_only=True)["module"]
        gates = [{k: torch.as_tensor(g[k]).float() for k in PARTS} for g in gates]
    except Exception as err:  # noqa: BLE001 - whatever the file holds, it is not a gates file: the user's input
        raise ParamError({"weights_path": path}, f": not a Fast KVzip gates file ({err}); {FETCH}") from None
    n_kv, n_q = config.num_key_value_heads, config.num_attention_heads
    dim = gates[0]["q_norm.weight"].shape[0] if gates else 0
    got = (len(gates), *gates[0]["k_proj.weight"].shape, gates[0]["q_proj.weight"].shape[0]) if gates else (0,)
    want = (config.num_hidden_layers, n_kv * dim, config.hidden_size, n_q * dim)
    check_shape(path, "gates", got, want, "layers, KV heads x dim, hidden size, query heads x dim", FETCH)
    return gates


def rms(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def gate_scores(gate: dict[str, Tensor], hidden: Tensor) -> Tensor:
    """(B, Hkv, T) a layer's gate scores for hidden states (B, T, hidden)."""
    b, t, _ = hidden.shape
    n_kv, _, n_sink, dim = gate["k_base"].shape
    q = rms((hidden @ gate["q_proj.weight"].T + gate["q_proj.bias"]).view(b, t, n_kv, -1, dim), gate["q_norm.weight"])
    k = rms((hidden @ gate["k_proj.weight"].T).view(b, t, n_kv, 1, dim), gate["k_norm.weight"])
    logit = (q * k).sum(-1) / dim**0.5 + gate["b"][:, 0]  # (B, T, Hkv, group)
    sinks = torch.einsum("hsd,bthgd->bthsg", gate["k_base"][:, 0], q) / dim**0.5  # (B, T, Hkv, sinks, group)
    score = 1 / (1 + (sinks - logit[:, :, :, None]).exp().sum(3))  # (B, T, Hkv, group)
    return score.mean(-1).transpose(1, 2)


@dataclass(kw_only=True)
class FastKVzip(RankedTogether):
    """The gates' scores from `weights_path`, sinks and the recent window first, ranked as KVzip ranks."""

    name: str = "fastkvzip"
    weights_path: str | None = None
    window_ratio: float = 0.02  # the share of the context kept as the recent window (contexts under 32,000 tokens)
    window_size: int = 4096  # the recent window from 32,000 tokens on

    def needs(self) -> tuple[HiddenStates]:
        return (HiddenStates(),)

    def prepare(self, model, probes) -> dict:
        self.gates = read_gates(self.weights_path, model.config.get_text_config())  # not a field
        return recorded(weights_file(self.weights_path))

    def window(self, seen: int) -> int:
        """The recent tokens that score 1 in a context of `seen` tokens."""
        return max(1, int(seen * self.window_ratio)) if seen < LONG else self.window_size

    def score(self, view: LayerView) -> Tensor:
        if not hasattr(self, "gates"):
            raise ValueError(f"{self.name}: the gates were not read (prepare() was not called)")
        scores = gate_scores(self.gates[view.layer_idx], context_hidden(view, self.name))
        first = (view.positions < self.n_sink) | (view.positions >= view.seen - self.window(view.seen))
        return scores.masked_fill(first, 1.0)

    def check_params(self) -> None:
        super().check_params()
        if self.weights_path is None:
            raise ParamError(
                {"weights_path": None}, f"fastkvzip needs its gates: give $weights_path=FILE ({FETCH})", unset=True
            )
        weights_file(self.weights_path)
        if not 0.0 <= self.window_ratio < 1.0 or self.window_size < 1:
            raise ParamError(
                {"window_ratio": self.window_ratio, "window_size": self.window_size},
                ": give a share in [0, 1) and a window of at least 1 token: 0.02 and 4096",
            )
