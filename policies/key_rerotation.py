"""KeyRerotation: any scorer's choice, with the kept keys re-rotated to contiguous positions.

The rotary trick of transformers' old SinkCache and of Finch (Corallo and Papotti 2024, "FINCH: Prompt-guided
Key-Value Cache Compression", TACL), as kvpress's KeyRerotationPress applies it: once the inner policy has chosen
which tokens a head keeps, the key in slot j (the kept tokens in their order) is rotated by j - p, p its original
position, so that the kept keys read as if the evicted tokens had never been there: RoPE rotations compose, R(j - p)
R(p) = R(j). Values are unchanged. The tokens that follow continue from the count held (`continues_from_held`: the
question at k, k+1, ...), as kvpress's pipeline continues after KeyRerotationPress; every layer must evict for that
(sliding-window models are refused).

A key's rotation is what its position was, so the kept keys are re-rotated once, after the prompt: this wrapper
neither evicts chunk by chunk nor while decoding (a second rotation would start from a slot, not a position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import rotate_half

from evalkit.errors import ConfigError
from evalkit.policies import LayerView, OnceWrapper, Probes, full_attention_only, gather_tokens


def rerotated(keys: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Keys (B, Hkv, k, D) held at `positions` (B, Hkv, k), rotated as if held at slots 0 .. k-1 (RoPE in the
    half-split layout transformers uses: angle (slot - position) x inv_freq on channel pairs (i, i + D/2))."""
    k = keys.shape[2]
    delta = torch.arange(k, device=keys.device, dtype=torch.float32) - positions.float()  # (B, Hkv, k)
    angles = delta[..., None] * inv_freq.float().to(keys.device)  # (B, Hkv, k, D/2)
    angles = torch.cat([angles, angles], dim=-1)
    return keys * angles.cos().to(keys.dtype) + rotate_half(keys) * angles.sin().to(keys.dtype)


def rotary_frequencies(model, name: str) -> Tensor:
    """The model's rotary frequencies (D/2,); a model whose rotary embedding scales its angles (attention_scaling
    other than 1) or has none cannot be re-rotated by the angles alone: a ConfigError naming the policy."""
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, Tensor) or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise ConfigError(
            f"{name} re-rotates keys by one rotary embedding with unscaled angles; "
            f"{type(model).__name__} has none such: choose another policy"
        )
    return inv_freq.detach()


def rerotated_tokens(view: LayerView, kept: Tensor, inv_freq: Tensor | None, name: str) -> tuple[Tensor, Tensor]:
    """The kept tokens' keys re-rotated to slots 0 .. k-1 and their values as held (`inv_freq`: read by prepare)."""
    if inv_freq is None:
        raise ValueError(f"{name}: the rotary frequencies were not read (prepare() was not called)")
    keys = gather_tokens(view.keys, kept)
    return rerotated(keys, gather_tokens(view.positions, kept), inv_freq), gather_tokens(view.values, kept)


@dataclass(kw_only=True)
class KeyRerotation(OnceWrapper):
    """The inner policy's choice; the kept keys re-rotated to slots 0 .. k-1, once, after the prompt."""

    name: str = "key_rerotation"

    def prepare(self, model, probes: Probes) -> dict | None:
        full_attention_only(
            model, self.name, "the question follows the re-rotated keys in every layer; choose the inner policy alone"
        )
        self.inv_freq = rotary_frequencies(model, self.name)  # not a field: not recorded, not compared
        return self.inner.prepare(model, probes)

    def continues_from_held(self) -> bool:
        return True

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor]:
        return rerotated_tokens(view, kept, getattr(self, "inv_freq", None), self.name)
