"""Per-layer compression: any scorer, with a budget of its own for every evicting layer.

kvpress's PerLayerCompressionPress (an experimental wrapper, no paper of its own): layers differ in how much of the
context they need, so each gets its own share. `layer_budgets` holds one fraction per evicting layer (in order; on a
hybrid model the sliding-window layers keep their own bound and are not listed), each a fraction of the tokens seen
as `budget` is; `budget` must be their mean, what the variant's label and the policy contract hold the cache to.
An empty list (the default) gives every layer `budget`: the inner policy as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import DynamicCache

from evalkit.errors import ParamError
from evalkit.policies import Probes, Wrapper, asked_tokens, held_tokens


def evicting_layers(model) -> int:
    """The model's layers that hold the whole context: the full-attention layers of the cache transformers makes for
    it (DynamicCache, as the engine's prefill does), not a sliding-window layer."""
    return sum(not getattr(layer, "is_sliding", False) for layer in DynamicCache(config=model.config).layers)


@dataclass(kw_only=True)
class PerLayer(Wrapper):
    """The inner policy's choice at each layer, held to that layer's own fraction of the tokens seen."""

    name: str = "per_layer"
    layer_budgets: list[float] = field(default_factory=list)

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        if not self.layer_budgets:
            return self.inner.keep_per_layer(seen, n_layers)
        self.check_layers(n_layers)
        return [held_tokens(asked_tokens(f, seen), seen, self.inner.min_tokens()) for f in self.layer_budgets]

    def check_layers(self, n_layers: int) -> None:
        if self.layer_budgets and len(self.layer_budgets) != n_layers:
            raise ParamError(
                {"layer_budgets": self.layer_budgets},
                f": {self.name} lists {len(self.layer_budgets)} fractions for the model's {n_layers} evicting layers; "
                "give one per layer",
            )

    def prepare(self, model, probes: Probes) -> dict | None:
        self.check_layers(evicting_layers(model))  # before any sample runs
        return super().prepare(model, probes)

    def check_params(self) -> None:
        super().check_params()
        fractions = self.layer_budgets
        if not fractions:
            return
        if not all(isinstance(f, float) and 0.0 < f <= 1.0 for f in fractions):
            raise ParamError(
                {"layer_budgets": fractions},
                ": give one fraction in (0, 1] per evicting layer, e.g. '[0.75,0.5,0.25]' for a 3-layer model",
            )
        mean = sum(fractions) / len(fractions)
        if not isinstance(self.budget, float) or abs(self.budget - mean) > 1e-6:
            raise ParamError(
                {"budget": self.budget},
                f" is not the mean of $layer_budgets ({mean:.6g}); give budget={mean:.6g}, which the cache is held to",
            )
