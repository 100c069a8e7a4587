"""What a policy needs recorded from attention: objects the policy declares, records and reads back itself.

A policy lists the observations it needs (`KVPolicy.needs()`), each an `Observation`: a frozen dataclass whose fields
are its settings, so that the equal observations of several variants are recorded once, and a layer's value is found
by the observation object itself (`LayerView.observed(obs)`), never by a name. The engine records every observation
through this one protocol, whatever it is:

- `prefill(at)`: at each full-attention layer of the prefill, its value from that forward's attention (`Attended`);
- `step(held, at)`: at each later forward on a cache that evicts (decode steps, chunks after the first), its new value
  from the one the layer holds;
- `second_pass(model, full, context, prompt)`: after the prefill, a pass of its own over the full cache, per layer
  (KVzip's reconstruction, policies/kvzip_pass.py); its seconds are recorded under `pass_name`.

A per-token observation (`per_token`, H2O's attention mass) holds one value per held token, (B, Hkv, T): gathered with
the keys at every eviction, zero for a new token. The others hold one value per layer. A new signal is therefore one
`Observation` subclass in its policy's file: the engine, the caches and the attention function stay as they are.

The engine hands the attention function one `Recorder` per forward (evalkit.attention.sdpa.observe): the prefill's
(`PrefillRecorder`), the steps' (`StepRecorder`), or one of a policy's own (DuoAttention's calibration).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from evalkit.attention.fused import attention_mass


@dataclass
class Attended:
    """One full-attention layer's attention in one forward, as an observation records it."""

    model: torch.nn.Module | None  # the model that ran the forward (a second pass, or its RoPE, may need it)
    query: Tensor  # (B, Hq, Tq, D) post-RoPE queries, the last Tq of the tokens seen
    key: Tensor  # (B, Hkv, Tk, D) the keys attended over
    scaling: float
    seen: int  # tokens the layer has seen, this forward's included: the queries are at positions seen - Tq ..
    given_mass: Tensor | None = None  # the mass computed with the output (evalkit.attention.fused), if asked for

    @property
    def mass(self) -> Tensor:
        """(B, Hkv, Tk) attention each key received from these queries, summed over queries and the query heads of
        its KV group: the one computed with the output where an observation asked (`wants_mass`), else here."""
        if self.given_mass is None:
            self.given_mass = attention_mass(self.query, self.key, self.scaling)
        return self.given_mass


class Observation:
    """Something a policy needs recorded from attention beyond the keys and values it holds (see the module doc).
    Subclasses are frozen dataclasses: equal settings, one recording."""

    per_token: ClassVar[bool] = False  # one value per held token (B, Hkv, T), gathered with the keys
    wants_mass: ClassVar[bool] = False  # reads `Attended.mass`: the attention then computes it with its output
    pass_name: ClassVar[str | None] = None  # a second pass of its own: the name its seconds are recorded under

    def prefill(self, at: Attended) -> object | None:
        """Its value at one full-attention layer of the prefill; None: nothing from the prefill."""
        return None

    def step(self, held: object, at: Attended) -> object:
        """Its value after a later forward on an evicting layer, from the value the layer held; unchanged here."""
        return held

    def second_pass(self, model: torch.nn.Module, full, context: Tensor, prompt) -> dict[int, object]:
        """After the prefill, per full-attention layer, its value from a pass of its own over the full cache `full`
        (left unchanged) and the context ids (1, n); `prompt`: the task's prompt parts the pass may need (the repeat
        prompt of evalkit's tasks, or None). Nothing here: most observations need no pass."""
        return {}


@dataclass(frozen=True)
class AttentionMass(Observation):
    """Per held token: the attention it has received, summed over every query so far and over the query heads of its
    KV group (H2O)."""

    per_token: ClassVar[bool] = True
    wants_mass: ClassVar[bool] = True

    def prefill(self, at: Attended) -> Tensor:
        return at.mass

    def step(self, held: Tensor, at: Attended) -> Tensor:
        return held + at.mass


@dataclass
class Window:
    """The last queries a layer has seen, scaled, (B, Hq, W, D), and their absolute positions (W,)."""

    queries: Tensor
    positions: Tensor


@dataclass(frozen=True)
class WindowQueries(Observation):
    """Per layer: the last `window` queries of the context, scaled (SnapKV, PyramidKV, TOVA). After compression every
    forward slides them on: an evicting layer then holds the last queries it has seen (with a chunked prefill, the
    latest chunk's; while decoding, the newest), so a policy that evicts while decoding scores with current queries."""

    window: int

    def prefill(self, at: Attended) -> Window:
        tk = at.key.shape[-2]
        queries = at.query[:, :, -self.window :].float() * at.scaling  # (B, Hq, W, D)
        return Window(queries, torch.arange(max(0, tk - self.window), tk, device=at.key.device))

    def step(self, held: Window, at: Attended) -> Window:
        # as many as the prefill recorded: its window, or the whole context where that was shorter
        w = held.queries.shape[-2]
        new = min(w, at.query.shape[-2])
        queries = at.query[:, :, -new:].float() * at.scaling
        positions = torch.arange(at.seen - new, at.seen, device=at.key.device)
        if new < w:  # fewer new queries than the window: keep the newest of the held ones
            queries = torch.cat([held.queries, queries], dim=2)[:, :, -w:]
            positions = torch.cat([held.positions, positions])[-w:]
        return Window(queries, positions)


@contextmanager
def attention_inputs(model: torch.nn.Module, record: Callable[[int, Tensor], None]) -> Iterator[None]:
    """Within the block, `record(layer_idx, hidden)` with the hidden states (B, L, hidden) that every attention module
    of `model` (one with a `layer_idx` and an `o_proj`) receives, after its layer's input norm: forward pre-hooks,
    removed afterwards. For an observation whose pass needs what the attention function does not see (KVzip+'s
    norms, KVzap's hidden states)."""

    def hook(module, args, kwargs):
        record(module.layer_idx, kwargs.get("hidden_states", args[0] if args else None))

    attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in attention]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


class Recorder(Protocol):
    """What the attention function hands each full or evicting layer's attention to, within one forward."""

    def wants_mass(self, layer_idx: int, layer) -> bool:
        """Whether this forward's attention mass at `layer` is read (then it is computed with the output)."""
        ...

    def record(self, layer_idx: int, layer, at: Attended) -> None: ...


@dataclass
class PrefillRecorder:
    """Records, per full-attention layer, the `observations` the variants of one prefill need."""

    needs: tuple[Observation, ...] = ()
    model: torch.nn.Module | None = None
    observations: dict[int, dict[Observation, object]] = field(default_factory=dict)
    # buffers the fused attention reuses from layer to layer of this prefill (evalkit.attention.fused): its float32
    # output and its score buffer, not a new pair per layer between the cache's tensors
    workspace: dict[str, Tensor] = field(default_factory=dict)

    def wants_mass(self, layer_idx: int, layer) -> bool:
        return any(o.wants_mass for o in self.needs) and not getattr(layer, "is_sliding", False)

    def record(self, layer_idx: int, layer, at: Attended) -> None:
        if getattr(layer, "is_sliding", False):
            return
        at.model = self.model
        got = self.observations.setdefault(layer_idx, {})
        for obs in self.needs:
            value = obs.prefill(at)
            if value is not None:
                got[obs] = value


class StepRecorder:
    """Observes forwards on a cache that already evicts (decode steps, and chunks after the first): every observation
    an evicting layer holds takes its `step`."""

    workspace = None

    def wants_mass(self, layer_idx: int, layer) -> bool:
        return any(o.wants_mass for o in (getattr(layer, "state", None) or {}))

    def record(self, layer_idx: int, layer, at: Attended) -> None:
        if getattr(layer, "state", None) is None:  # a plain (sliding-window) layer
            return
        layer.state = {obs: obs.step(held, at) for obs, held in layer.state.items()}
        # a new dict: caches that share this layer's tensors keep their own observations
        layer.observations = {obs: obs.step(held, at) for obs, held in layer.observations.items()}
