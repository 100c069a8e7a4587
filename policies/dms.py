"""DMS as kvpress's DMSPress runs it: evict every token an inner scorer scores below a threshold, the recent ones kept.

After Dynamic Memory Sparsification (Łańcucki et al. 2025, arXiv:2506.05345), in the form kvpress's DMSPress gives
it: a dense prefill, then, per KV head, the tokens before the last `window` whose inner score is below `threshold` are
evicted, whatever their number (the trained per-head evictors of the paper are not part of it: the scores are the
inner policy's, KVzap's in kvpress's pairing). Heads then hold different counts (stored ragged, as adakv's), and the
memory saved follows from the threshold and the prompt: `budget` stays 1.0 and the records show what each head held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import LayerView, Wrapper, checked_scores, no_budget, padded_indices


@dataclass(kw_only=True)
class DMS(Wrapper):
    """Per KV head: every token of the last `window`, and each earlier one the inner policy scores >= `threshold`."""

    name: str = "dms"
    threshold: float | None = None  # required: it is in the inner scores' units (KVzap's: the log of KVzip+'s)
    window: int = 128  # kvpress's sliding_window_size: the most recent tokens, never evicted
    decode: bool | None = False  # compress the prompt once (kvpress's decoding=False, its default)
    decodable: ClassVar[bool] = False
    chunkable: ClassVar[bool] = False
    ragged: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False  # its choice is a threshold, not a score

    def compresses(self) -> bool:
        return True  # its threshold evicts whatever its budget (1.0)

    def over(self, view: LayerView, k: int) -> bool:
        return view.keys.shape[2] > self.window

    def select(self, view: LayerView, k: int) -> Tensor:
        scores = checked_scores(self, self.score(view), view)
        kept = scores >= self.threshold
        if self.window:
            kept[..., -self.window :] = True
        return padded_indices(kept & view.real)

    def check_params(self) -> None:
        no_budget(
            self.budget,
            "DMS keeps every token its inner policy scores at or above $threshold and the last $window; "
            "set what it saves with the threshold",
        )
        if self.threshold is None:
            raise ParamError(
                {"threshold": None},
                "dms needs $threshold, in its inner policy's score units (with kvzap, the log of a KVzip+ score, "
                "e.g. -6): tokens before the last $window that score below it are evicted",
                unset=True,
            )
        if self.window < 0:
            raise ParamError({"window": self.window}, ": the recent tokens kept, a whole number >= 0, e.g. 128")
        super().check_params()
