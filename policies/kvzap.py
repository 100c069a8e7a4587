"""KVzap: a small learned model per layer predicts each token's KVzip score from the hidden state entering attention.

KVzap (arXiv:2601.07891), as kvpress's KVzapPress scores: per layer, a surrogate (a linear map, or a two-layer MLP
with a GELU) takes the hidden state each token brings to the layer's attention (after the input norm) and gives one
score per KV head, a fast stand-in for KVzip's reconstruction pass; each KV head keeps its k highest.

evalkit never reaches the Hub at run time: the surrogates come from a local folder, `policy.weights_path`, in the
format kvpress's KVzapModel saves (`config.json` with input_dim, output_dim, n_modules and hidden_dim, null for the
linear model; `model.safetensors` with `layers.<i>.weight` and `.bias`, or `layers.<i>.0.*` and `layers.<i>.2.*` for
the MLP). On a connected machine:

    huggingface-cli download nvidia/KVzap-mlp-<model name> --local-dir kvzap/<model name>

or fit a linear stand-in here (`python -m evalkit.calibrate kvzap`). The folder's path and SHA-256 are recorded in
run.json.

The attention function sees queries and keys, not hidden states, so the hidden states are read in a forward of their
own over the context (`HiddenStates`, a second pass whose seconds are recorded as `hidden`): kvpress reads them in its
prefill hook. The cost is one more prefill; the scores are the same.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.attention.observation import Observation, attention_inputs
from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.weights import check_shape, read_tensors, recorded, weights_file

FETCH = "huggingface-cli download nvidia/KVzap-mlp-<model> --local-dir DIR, or python -m evalkit.calibrate kvzap"


@dataclass(frozen=True)
class HiddenStates(Observation):
    """Per attention layer, (B, T, hidden): the hidden states the layer's attention receives over the context, read
    in a forward of the model over the context ids with no cache (the prefilled cache is not touched)."""

    pass_name: ClassVar[str] = "hidden"

    def second_pass(self, model: torch.nn.Module, full, context: Tensor, prompt) -> dict[int, Tensor]:
        got: dict[int, Tensor] = {}

        def record(layer_idx: int, hidden: Tensor) -> None:
            got[layer_idx] = hidden.float()

        with attention_inputs(model, record):
            model(context, use_cache=False)
        return got


def context_hidden(view: LayerView, name: str) -> Tensor:
    """(B, T, hidden) the hidden states `HiddenStates` read over the context, for a layer that holds the whole context
    (a policy that scores from them compresses once, after the prompt); a ValueError naming the policy `name` else."""
    hidden = view.observed(HiddenStates())
    if hidden.shape[1] != view.keys.shape[2]:
        raise ValueError(f"{name}: layer {view.layer_idx} holds {view.keys.shape[2]} tokens, not the context")
    return hidden


def surrogates(path: str, config) -> tuple[list[Callable[[Tensor], Tensor]], str]:
    """Per layer, the surrogate of the folder `path` (hidden states (B, T, hidden) -> scores (B, T, Hkv)), checked
    against the model's `config`, and which kind it is ("linear" or "mlp")."""
    try:
        spec = json.loads((weights_file(path).parent / "config.json").read_text())
        n, hidden = int(spec["n_modules"]), spec.get("hidden_dim")
        dims = (int(spec["n_modules"]), int(spec["input_dim"]), int(spec["output_dim"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        why = f"no KVzap config.json beside the weights ({err})"
        raise ParamError({"weights_path": path}, f": {why}; {FETCH}") from None
    want = (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads)
    check_shape(path, "surrogates", dims, want, "layers, hidden size, KV heads", FETCH)
    parts = (".weight", ".bias") if hidden is None else (".0.weight", ".0.bias", ".2.weight", ".2.bias")
    names = tuple(f"layers.{i}{p}" for i in range(n) for p in parts)
    w = read_tensors(path, names, "a KVzap model", FETCH)

    def linear(i: int) -> Callable[[Tensor], Tensor]:
        weight, bias = w[f"layers.{i}.weight"].float(), w[f"layers.{i}.bias"].float()
        return lambda x: x @ weight.T + bias

    def mlp(i: int) -> Callable[[Tensor], Tensor]:
        w1, b1, w2, b2 = (w[f"layers.{i}{p}"].float() for p in parts)
        return lambda x: torch.nn.functional.gelu(x @ w1.T + b1) @ w2.T + b2

    return [(linear if hidden is None else mlp)(i) for i in range(n)], "linear" if hidden is None else "mlp"


@dataclass(kw_only=True)
class KVzap(KVPolicy):
    """Per KV head: top-k by the layer's surrogate applied to the hidden states, read from `weights_path`."""

    name: str = "kvzap"
    weights_path: str | None = None
    decode: bool = False  # kvpress's KVzapPress scores the prompt, as evalkit's: the hidden states are the context's
    decodable: ClassVar[bool] = False
    chunkable: ClassVar[bool] = False  # the hidden states are read over the whole context

    def needs(self) -> tuple[HiddenStates]:
        return (HiddenStates(),)

    def prepare(self, model, probes) -> dict:
        self.surrogates, kind = surrogates(self.weights_path, model.config.get_text_config())  # not fields
        return {**recorded(weights_file(self.weights_path)), "model_type": kind}

    def score(self, view: LayerView) -> Tensor:
        if not hasattr(self, "surrogates"):
            raise ValueError(f"{self.name}: the surrogates were not read (prepare() was not called)")
        hidden = context_hidden(view, self.name)
        return self.surrogates[view.layer_idx](hidden).transpose(1, 2)  # (B, Hkv, T)

    def check_params(self) -> None:
        if self.weights_path is None:
            raise ParamError(
                {"weights_path": None},
                f"kvzap needs its surrogate models: give $weights_path=DIR ({FETCH})",
                unset=True,
            )
        weights_file(self.weights_path)
