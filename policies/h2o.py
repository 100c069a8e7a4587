"""H2O: heavy hitters by accumulated attention, plus a recent window.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(arXiv:2306.14048). A token's score is the attention mass it has received, summed over every query so far: over
all context queries at prefill end, then updated by every new query during decode, where the lowest-mass token
outside the recent window is evicted whenever the budget is exceeded.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from evalkit.attention.observation import AttentionMass
from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView

MASS = AttentionMass()


@dataclass(kw_only=True)
class H2O(KVPolicy):
    """Keep the heaviest hitters; `recent` is the share of the budget reserved for the most recent tokens."""

    name: str = "h2o"
    recent: float = 0.5
    # False (the paper and its code): the raw accumulated mass, which favours early tokens, seen by more queries.
    # True: the mass divided by the number of queries that saw the key (seen - position, causally), as kvpress's
    # ObservedAttentionPress scores; the choice is recorded with the policy in every row.
    normalize: bool = False

    def needs(self) -> tuple[AttentionMass]:
        return (MASS,)

    def score(self, view: LayerView) -> Tensor:
        mass = view.observed(MASS)
        if not self.normalize:
            return mass
        return mass / (view.seen - view.positions).to(mass.dtype)

    def protected(self, view: LayerView, k: int) -> Tensor:
        return view.positions >= view.seen - int(self.recent * k)

    def min_tokens(self) -> int:
        return 2

    def check_params(self) -> None:
        if not 0.0 <= self.recent <= 1.0:
            raise ParamError(
                {"recent": self.recent},
                " is outside [0, 1] (the share of the budget kept for the most recent tokens); give e.g. $recent=0.5",
            )
