"""KV storage quantized KIVI-style (Liu et al. 2024, arXiv:2402.02750), as a transformers cache layer.

Keys are quantized per channel (groups of `group` tokens share a scale per channel), values per token (groups of
`group` channels); codes are packed into uint8, scales and minima kept in fp16. The most recent tokens stay in
full precision in a residual window and are flushed into the packed store a whole group at a time, keeping at
least `residual` tokens unquantized. Decoding one token reads the packed store directly (evalkit.kernels'
decode attention); several tokens at once (the question) attend over the dequantized history with SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from evalkit import kernels
from evalkit.attention import fit_mask
from evalkit.cache import EvictingLayer
from evalkit.errors import ConfigError


@dataclass(frozen=True)
class QuantSpec:
    """How a cache is stored: `bits` per value (8, 4 or 2), `group` size, `residual` full-precision tokens; or,
    with `format: e4m3`, FP8 with one fp16 scale per token and head."""

    name: str
    bits: int
    group: int = 64
    residual: int = 32
    format: str = "int"  # int (KIVI) or e4m3 (FP8)

    def validate(self, head_dim: int | None = None) -> None:
        if self.format == "e4m3":
            if not hasattr(torch, "float8_e4m3fn"):
                raise ConfigError(f"quant={self.name}: this torch ({torch.__version__}) has no float8_e4m3fn")
            return
        if self.format != "int":
            raise ConfigError(f"quant.format={self.format!r} is not one of ['int', 'e4m3']")
        if self.bits not in kernels.BITS:
            raise ConfigError(f"quant.bits={self.bits} is not one of {list(kernels.BITS)}")
        if self.group < 8 or self.group & (self.group - 1):
            raise ConfigError(f"quant.group={self.group} must be a power of two >= 8")
        if self.residual < 0:
            raise ConfigError(f"quant.residual={self.residual} must be >= 0")
        if head_dim is not None and head_dim % self.group:
            raise ConfigError(
                f"quant.group={self.group} must divide the model's head_dim={head_dim} (values are "
                "grouped along the channels); choose a smaller quant.group"
            )


class QuantizedLayer(EvictingLayer):
    """A full-attention layer whose held tokens are stored packed, plus a full-precision residual window."""

    def __init__(self, layer: EvictingLayer, spec: QuantSpec):
        b, h, t, d = layer.keys.shape
        spec.validate(d)
        super().__init__(layer.keys[:, :, :0], layer.values[:, :, :0], layer.seen, observations=layer.observations)
        self.spec, self.head_dim = spec, d
        self.positions = layer.positions
        self.k_packed = layer.keys.new_zeros(b, h, d, 0, dtype=torch.uint8)  # (B, Hkv, D, Tq*bits/8)
        self.k_scale = layer.keys.new_zeros(b, h, d, 0, dtype=torch.float16)  # (B, Hkv, D, Tq/group)
        self.k_min = self.k_scale.clone()
        self.v_packed = layer.keys.new_zeros(b, h, 0, d * spec.bits // 8, dtype=torch.uint8)  # (B, Hkv, Tq, ...)
        self.v_scale = layer.keys.new_zeros(b, h, 0, d // spec.group, dtype=torch.float16)  # (B, Hkv, Tq, D/group)
        self.v_min = self.v_scale.clone()
        self.keys, self.values = layer.keys, layer.values  # the residual window, before the first flush
        self._flush()

    @property
    def quantized(self) -> int:
        return self.v_packed.shape[2]

    @property
    def held(self) -> int:
        return self.quantized + self.keys.shape[-2]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        super().update(key_states, value_states)
        self._flush()
        return self.keys, self.values  # the residual; `attend` reads the packed history itself

    def _flush(self) -> None:
        """Move the oldest residual tokens into the packed store, whole groups only, keeping `residual` behind."""
        n = (self.keys.shape[2] - self.spec.residual) // self.spec.group * self.spec.group
        if n <= 0:
            return
        new = kernels.quantize_kv(self.keys[:, :, :n], self.values[:, :, :n], self.spec.bits, self.spec.group)
        old = self.packed()
        # keys grow along their last dim (tokens, per channel), values along dim 2 (tokens)
        parts = [torch.cat([o, x], dim=-1 if i < 3 else 2) for i, (o, x) in enumerate(zip(old, new, strict=True))]
        self.k_packed, self.k_scale, self.k_min, self.v_packed, self.v_scale, self.v_min = parts
        self.keys, self.values = self.keys[:, :, n:], self.values[:, :, n:]

    def packed(self) -> tuple[Tensor, ...]:
        """The packed history: key codes, scales, minima, then value codes, scales, minima."""
        return self.k_packed, self.k_scale, self.k_min, self.v_packed, self.v_scale, self.v_min

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """(B, Hkv, T_held, D) keys and values in the residual's dtype: the packed history, then the residual."""
        b, h, t, d = self.k_packed.shape[0], self.k_packed.shape[1], self.quantized, self.head_dim
        bits, group = self.spec.bits, self.spec.group
        k = (
            kernels.dequantize(
                self.k_packed.flatten(0, 2), self.k_scale.flatten(0, 2), self.k_min.flatten(0, 2), bits, group
            )
            .view(b, h, d, t)
            .transpose(-1, -2)
        )
        v = kernels.dequantize(
            self.v_packed.flatten(0, 2), self.v_scale.flatten(0, 2), self.v_min.flatten(0, 2), bits, group
        ).view(b, h, t, d)
        dtype = self.keys.dtype
        return torch.cat([k.to(dtype), self.keys], dim=2), torch.cat([v.to(dtype), self.values], dim=2)

    def attend(self, module, query: Tensor, attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
        """Attention of `query` (B, Hq, Tq, D) over everything held; returns (B, Tq, Hq, D) like transformers'."""
        scaling = kwargs.get("scaling") or module.scaling
        if query.shape[2] == 1:
            out = kernels.decode_attention(
                query[:, :, 0], *self.packed(), self.keys, self.values, self.spec.bits, self.spec.group, scaling
            )  # (B, Hq, D)
            return out.to(query.dtype)[:, None], None
        keys, values = self.dequantized()
        return sdpa_attention_forward(module, query, keys, values, fit_mask(attention_mask, query, keys), **kwargs)

    def nbytes(self) -> int:
        """Packed codes, fp16 scales and minima, and the full-precision residual, as held."""
        tensors = (*self.packed(), self.keys, self.values)
        return sum(t.numel() * t.element_size() for t in tensors)

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("eviction from a quantized store: evict first, then quantize")


FP8_MAX = 448.0  # largest finite float8_e4m3fn


FP16_TINY = torch.finfo(torch.float16).tiny  # smallest normal fp16: a scale never rounds to zero


def to_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(B, H, T, D) -> FP8 e4m3 codes and an fp16 scale per token and head (B, H, T, 1): x ~ codes * scale.

    The scale is floored in fp16 itself (a floor applied before the cast, such as 1e-12, rounds to 0 and turns a
    near-zero token into NaN codes), and codes are clamped to e4m3's finite range, which the fp16 rounding of the
    scale could otherwise exceed by a hair."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).half().clamp_min(FP16_TINY)
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Fp8Layer(EvictingLayer):
    """A full-attention layer whose held tokens, new ones included, are stored as FP8 (e4m3) codes."""

    def __init__(self, layer: EvictingLayer, spec: QuantSpec):
        super().__init__(layer.keys[:, :, :0], layer.values[:, :, :0], layer.seen, observations=layer.observations)
        self.spec, self.dtype, self.positions = spec, layer.keys.dtype, layer.positions
        (self.k8, self.k_scale), (self.v8, self.v_scale) = to_fp8(layer.keys), to_fp8(layer.values)

    @property
    def held(self) -> int:
        return self.k8.shape[2]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.advance(key_states.shape[2])
        (k8, ks), (v8, vs) = to_fp8(key_states), to_fp8(value_states)
        self.k8, self.k_scale = torch.cat([self.k8, k8], dim=2), torch.cat([self.k_scale, ks], dim=2)
        self.v8, self.v_scale = torch.cat([self.v8, v8], dim=2), torch.cat([self.v_scale, vs], dim=2)
        return self.keys, self.values  # empty: `attend` reads the FP8 store

    def attend(self, module, query: Tensor, attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
        keys = (self.k8.float() * self.k_scale.float()).to(self.dtype)
        values = (self.v8.float() * self.v_scale.float()).to(self.dtype)
        return sdpa_attention_forward(module, query, keys, values, fit_mask(attention_mask, query, keys), **kwargs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k8, self.k_scale, self.v8, self.v_scale))

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("eviction from an FP8 store: evict first, then quantize")


def quantize_cache(cache: Cache, spec: QuantSpec) -> Cache:
    """Store the held tokens of every evicting layer quantized; sliding-window layers stay as they are."""
    kind = Fp8Layer if spec.format == "e4m3" else QuantizedLayer
    return Cache(layers=[kind(layer, spec) if isinstance(layer, EvictingLayer) else layer for layer in cache.layers])
