"""LU-KV: a budget per layer and KV head read from a precomputed curve, filled by any scorer.

"Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache Eviction"
(arXiv:2602.08585), as kvpress's LUKVPress applies it. A wrapper: the curve, (99, layers, KV heads), gives for each
prune ratio of 1% to 99% the share of its tokens each layer's KV head gives up; the inner policy's scores (Expected
Attention with epsilon 0.02, as kvpress's default) choose which, the first `sink` and last `window` tokens first.
Per layer, the heads keep round(sum of keep rate x tokens) in all, each its floor and the rest to the largest
fractional parts, at least 1 each (kvpress's rule). Heads keep different counts: the layer is stored ragged.

The curve is learned per model and scorer: it comes from `policy.weights_path`, a numpy file (`.npy`) as LU-KV's
repository writes and kvpress downloads them (published for Llama-3.1-8B-Instruct with Expected Attention), or one
computed here (`python -m evalkit.calibrate lukv`: evalkit's stand-in calibration, not LU-KV's optimisation). The
curve's row is the budget's prune ratio in whole percents, rounded up so that a budget is never exceeded (kvpress rounds
to the nearest); a curve whose rows keep more on average than their ratio allows is refused. Its path and SHA-256 go
into run.json under `prepared`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, Wrapper, best_per_head, checked_scores, padded_indices
from evalkit.policies.weights import check_shape, recorded

FETCH = "LU-KV's curve_data/*.npy (github.com/baidu-baige/LU-KV), or python -m evalkit.calibrate lukv --out FILE"


def head_counts(keep_rates: Tensor, t: int) -> Tensor:
    """(Hkv,) tokens each head keeps of t: round(sum of keep_rate x t) over the heads, each its floor and the rest
    to the largest fractional parts, clamped to [1, t] (kvpress's LUKVPress)."""
    ideal = keep_rates.clamp(0.0, 1.0) * t
    h = ideal.shape[0]
    total = max(h, min(h * t, int(torch.round(ideal.sum()))))
    counts = ideal.floor().long()
    rest = total - int(counts.sum())
    if rest > 0:
        counts[(ideal - counts).topk(min(rest, h)).indices] += 1
    return counts.clamp(1, t)


@dataclass(kw_only=True)
class LUKV(Wrapper):
    """Each layer's and KV head's share from the curve of `weights_path`, chosen by the inner policy's scores."""

    name: str = "lukv"  # recorded as lukv(INNER)
    sink: int = 4
    window: int = 1
    weights_path: str | None = None
    decode: bool = False  # compresses the prompt once

    decodable: ClassVar[bool] = False
    chunkable: ClassVar[bool] = False
    ragged: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False

    def prepare(self, model, probes) -> dict:
        path = self.curve_file()
        try:
            curve = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ParamError({"weights_path": self.weights_path}, f": not a numpy curve ({err}); {FETCH}") from None
        cfg = model.config.get_text_config()
        want = (99, cfg.num_hidden_layers, cfg.num_key_value_heads)
        check_shape(self.weights_path, "a curve", curve.shape, want, "99 prune ratios, layers, KV heads", FETCH)
        kept = 1 - curve.mean(axis=(1, 2))
        worst = int(np.argmax(kept - (1 - np.arange(1, 100) / 100)))
        if kept[worst] > 1 - (worst + 1) / 100 + 1e-3:
            raise ParamError(
                {"weights_path": self.weights_path},
                f": its row for a prune ratio of {worst + 1}% keeps "
                f"{kept[worst]:.3f} of the tokens on average, more than {1 - (worst + 1) / 100:.2f}; fix the curve",
            )
        self.curve = torch.as_tensor(curve, dtype=torch.float32)  # not a field: not recorded, not compared
        prepared = self.inner.prepare(model, probes) or {}
        return {**prepared, **recorded(path)}

    def curve_file(self) -> Path:
        path = Path(self.weights_path).expanduser()
        if not path.is_file():
            raise ParamError({"weights_path": self.weights_path}, f": no such file ({FETCH})")
        return path

    def row(self, seen: int) -> int | None:
        """The curve's row: the prune ratio (1 - the budget's fraction, or 1 - tokens / seen) in whole percents,
        rounded up, less one; None when the budget keeps every token (kvpress: a ratio of 0 compresses nothing)."""
        kept = self.budget if isinstance(self.budget, float) else min(seen, self.budget) / seen
        pruned = math.ceil(round((1 - kept) * 100, 6))
        return None if pruned <= 0 else min(98, pruned - 1)

    def counts(self, layer_idx: int, seen: int) -> Tensor:
        """(Hkv,) the tokens each KV head of the layer keeps of `seen`."""
        if not hasattr(self, "curve"):
            raise ValueError(f"{self.name}: the curve was not read (prepare() was not called)")
        row = self.row(seen)
        if row is None:
            return torch.full((self.curve.shape[2],), seen, dtype=torch.long)
        return head_counts(1 - self.curve[row, layer_idx], seen)

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        """Per layer, its heads' total over their number, rounded up (a ragged layer holds at most k x Hkv)."""
        return [math.ceil(int(self.counts(i, seen).sum()) / self.curve.shape[2]) for i in range(n_layers)]

    def over(self, view: LayerView, k: int) -> bool:
        return int(view.real.sum(dim=(1, 2)).max()) > int(self.counts(view.layer_idx, view.seen).sum())

    def protected(self, view: LayerView, k: int) -> Tensor:
        ends = (view.positions < self.sink) | (view.positions >= view.seen - self.window)
        inner = self.inner.protected(view, k)
        return ends if inner is None else ends | inner

    def min_tokens(self) -> int:
        return max(self.inner.min_tokens(), self.sink + self.window + 1)

    def select(self, view: LayerView, k: int) -> Tensor:
        scores = checked_scores(self.inner, self.inner.score(view), view).masked_fill(self.protected(view, k), math.inf)
        return padded_indices(best_per_head(scores, self.counts(view.layer_idx, view.seen).to(scores.device)))

    def check_params(self) -> None:
        if self.sink < 0 or self.window < 0:
            raise ParamError({"sink": self.sink, "window": self.window}, ": give counts >= 0 (4 and 1)")
        if self.weights_path is None:
            raise ParamError(
                {"weights_path": None}, f"lukv needs its budget curve: give $weights_path=FILE ({FETCH})", unset=True
            )
        self.curve_file()
        super().check_params()
