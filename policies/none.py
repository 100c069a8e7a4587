"""The full cache: keeps every token. The reference every other policy is compared against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from evalkit.policies import KVPolicy, LayerView


@dataclass(kw_only=True)
class FullCache(KVPolicy):
    """Keeps every token at every step; its budget is always the tokens seen."""

    name: str = "none"
    decode: bool = False
    budget_counts_tokens: ClassVar[bool] = False  # its budget is always the tokens seen

    def target(self, seen: int) -> int:
        return seen

    def protected(self, view: LayerView, k: int) -> Tensor:
        return view.real  # every token, whatever the budget says: the policy contract counts them (evalkit.contract)

    def compresses(self) -> bool:
        return False
