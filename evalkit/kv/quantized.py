"""KV storage quantized KIVI-style (Liu et al. 2024, arXiv:2402.02750), as a transformers cache layer.

Keys are quantized per channel (groups of `group` tokens share a scale per channel), values per token (groups of
`group` channels); codes are packed into uint8, scales and minima kept in fp16. The most recent tokens stay in a
residual window, in the dtype a deployment holds (fp16, or bf16 for a bf16 model), and are flushed into the packed
store a whole group at a time, keeping at least `residual` tokens there.

Each layer's `update()` returns what attention must read, so the layer owns its attention wherever it is used
(`attention_path` names the path):

- `packed-triton` / `packed-reference` (CUDA, or `cpu_path: packed`): decoding one token reads the packed store
  directly (evalkit.kernels' decode attention, through `evalkit_sdpa`); several tokens at once (the question) attend
  over the dequantized history with SDPA.
- `dequantized-cache` (the CPU's default for a float32 model): SDPA over a copy of the exact values the packed kernel
  reads (the dequantized history, then the residual), kept in step as groups are flushed, not dequantized again every
  step. Bytes are still those of the packed layout: the copy is a CPU speed-up, not what a deployment holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from evalkit import kernels
from evalkit.attention.sdpa import require_named
from evalkit.errors import ConfigError
from evalkit.kv.cache import EvictingLayer

CPU_PATHS = ("dequantized-cache", "packed")


@dataclass(frozen=True)
class QuantSpec:
    """How a cache is stored: `bits` per value (8, 4 or 2), `group` size, `residual` full-precision tokens; or,
    with `format: e4m3`, FP8 with one fp16 scale per token and head. `cpu_path`: how the CPU attends (CUDA always
    reads the packed store)."""

    name: str
    bits: int
    group: int = 64
    residual: int = 32
    format: str = "int"  # int (KIVI) or e4m3 (FP8)
    cpu_path: str = "dequantized-cache"  # or "packed": the kernels' path, as on CUDA (slow on the CPU)

    def validate(self, head_dim: int | None = None) -> None:
        if self.cpu_path not in CPU_PATHS:
            raise ConfigError(f"quant.cpu_path={self.cpu_path!r} is not one of {list(CPU_PATHS)}")
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

    def cached(self, x: Tensor) -> bool:
        """Whether layers holding x attend over a dequantized copy: on the CPU unless cpu_path says packed, where the
        copy holds exactly what the packed path reads (FP8: always; int: in float32, as the decode kernel reads)."""
        exact = self.format == "e4m3" or x.dtype == torch.float32
        return not x.is_cuda and self.cpu_path == "dequantized-cache" and exact


def deployment_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a deployment holds full-precision KV in: bf16 for a bf16 model, fp16 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


class QuantizedLayer(EvictingLayer):
    """A full-attention layer whose held tokens are stored packed, plus a residual window in the deployment dtype."""

    def __init__(self, layer: EvictingLayer, spec: QuantSpec):
        b, h, t, d = layer.keys.shape
        spec.validate(d)
        super().__init__(layer.keys[:, :, :0], layer.values[:, :, :0], layer.seen, observations=layer.observations)
        self.spec, self.head_dim, self.dtype = spec, d, layer.keys.dtype  # attention computes in the model's dtype
        self.positions, self.allowed, self.next_position = layer.positions, layer.allowed, layer.next_position
        self.k_packed = layer.keys.new_zeros(b, h, d, 0, dtype=torch.uint8)  # (B, Hkv, D, Tq*bits/8)
        self.k_scale = layer.keys.new_zeros(b, h, d, 0, dtype=torch.float16)  # (B, Hkv, D, Tq/group)
        self.k_min = self.k_scale.clone()
        self.v_packed = layer.keys.new_zeros(b, h, 0, d * spec.bits // 8, dtype=torch.uint8)  # (B, Hkv, Tq, ...)
        self.v_scale = layer.keys.new_zeros(b, h, 0, d // spec.group, dtype=torch.float16)  # (B, Hkv, Tq, D/group)
        self.v_min = self.v_scale.clone()
        store = deployment_dtype(self.dtype)
        self.keys, self.values = layer.keys.to(store), layer.values.to(store)  # the residual, before the first flush
        self.k_all = self.v_all = None  # the dequantized copy (B, Hkv, T_held, D), on the dequantized-cache path
        self._flush()
        if spec.cached(layer.keys):
            self.attention_path = "dequantized-cache"
            self.k_all, self.v_all = self.dequantized()
        else:
            self.attention_path = "packed-triton" if kernels.use_triton(layer.keys) else "packed-reference"

    @property
    def quantized(self) -> int:
        return self.v_packed.shape[2]

    @property
    def held(self) -> int:
        return self.quantized + self.keys.shape[-2]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store the new tokens; return the keys and values attention reads (see the module's docstring)."""
        key_states, value_states = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)
        super().update(key_states, value_states)
        if self.k_all is not None:
            self.k_all = torch.cat([self.k_all, key_states.to(self.dtype)], dim=2)
            self.v_all = torch.cat([self.v_all, value_states.to(self.dtype)], dim=2)
        self._flush()
        if self.k_all is not None:
            return self.k_all, self.v_all
        if key_states.shape[2] > 1:
            return self.dequantized()
        require_named(kwargs, self)
        return self.keys, self.values  # the residual: `attend` reads the packed history itself (see `attends`)

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
        if self.k_all is not None:  # the flushed tokens now read as their dequantized values
            k, v = self._dequantize(new)
            q0 = self.quantized - n
            self.k_all = torch.cat([self.k_all[:, :, :q0], k, self.k_all[:, :, q0 + n :]], dim=2)
            self.v_all = torch.cat([self.v_all[:, :, :q0], v, self.v_all[:, :, q0 + n :]], dim=2)

    def packed(self) -> tuple[Tensor, ...]:
        """The packed history: key codes, scales, minima, then value codes, scales, minima."""
        return self.k_packed, self.k_scale, self.k_min, self.v_packed, self.v_scale, self.v_min

    def _dequantize(self, parts: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """The six packed tensors of `packed()`'s layout -> (B, Hkv, T, D) keys and values in the model's dtype."""
        kp, ks, km, vp, vs, vm = parts
        b, h, t, d = vp.shape[0], vp.shape[1], vp.shape[2], self.head_dim
        bits, group = self.spec.bits, self.spec.group
        k = kernels.dequantize(kp.flatten(0, 2), ks.flatten(0, 2), km.flatten(0, 2), bits, group)
        v = kernels.dequantize(vp.flatten(0, 2), vs.flatten(0, 2), vm.flatten(0, 2), bits, group)
        return k.view(b, h, d, t).transpose(-1, -2).to(self.dtype), v.view(b, h, t, d).to(self.dtype)

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """(B, Hkv, T_held, D) keys and values in the model's dtype: the packed history, then the residual."""
        k, v = self._dequantize(self.packed())
        return torch.cat([k, self.keys.to(self.dtype)], dim=2), torch.cat([v, self.values.to(self.dtype)], dim=2)

    def attends(self, query: Tensor) -> bool:
        """Whether this forward's attention is `attend`'s (evalkit.attention.sdpa): one query decoding over the packed
        store, where `update` returned only the residual; else the keys `update` returned are all the tokens."""
        return self.k_all is None and query.shape[-2] == 1

    def attend(self, module, query: Tensor, attention_mask: Tensor | None, **kwargs) -> tuple[Tensor, None]:
        """Decode attention of one query (B, Hq, 1, D) over the packed history and the residual, read directly;
        returns (B, 1, Hq, D) like transformers' attention functions."""
        scaling = kwargs.get("scaling") or module.scaling
        out = kernels.decode_attention(
            query[:, :, 0], *self.packed(), self.keys, self.values, self.spec.bits, self.spec.group, scaling
        )  # (B, Hq, D), float32
        return out.to(query.dtype)[:, None], None

    def nbytes(self) -> int:
        """Packed codes, fp16 scales and minima, and the residual, as a deployment holds them (not the CPU's
        dequantized copy)."""
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


def from_fp8(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (codes.float() * scale.float()).to(dtype)


class Fp8Layer(EvictingLayer):
    """A full-attention layer whose held tokens, new ones included, are stored as FP8 (e4m3) codes. `update()`
    returns them dequantized: kept as a copy on the CPU (`dequantized-cache`), dequantized at every forward
    elsewhere (`packed-reference`)."""

    def __init__(self, layer: EvictingLayer, spec: QuantSpec):
        super().__init__(layer.keys[:, :, :0], layer.values[:, :, :0], layer.seen, observations=layer.observations)
        self.spec, self.dtype, self.positions, self.allowed = spec, layer.keys.dtype, layer.positions, layer.allowed
        self.next_position = layer.next_position
        (self.k8, self.k_scale), (self.v8, self.v_scale) = to_fp8(layer.keys), to_fp8(layer.values)
        self.k_all = self.v_all = None
        self.attention_path = "dequantized-cache" if spec.cached(layer.keys) else "packed-reference"
        if spec.cached(layer.keys):
            self.k_all, self.v_all = self.dequantized()

    @property
    def held(self) -> int:
        return self.k8.shape[2]

    def dequantized(self) -> tuple[Tensor, Tensor]:
        return from_fp8(self.k8, self.k_scale, self.dtype), from_fp8(self.v8, self.v_scale, self.dtype)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.advance(key_states.shape[2])
        (k8, ks), (v8, vs) = to_fp8(key_states), to_fp8(value_states)
        self.k8, self.k_scale = torch.cat([self.k8, k8], dim=2), torch.cat([self.k_scale, ks], dim=2)
        self.v8, self.v_scale = torch.cat([self.v8, v8], dim=2), torch.cat([self.v_scale, vs], dim=2)
        if self.k_all is None:
            return self.dequantized()
        self.k_all = torch.cat([self.k_all, from_fp8(k8, ks, self.dtype)], dim=2)
        self.v_all = torch.cat([self.v_all, from_fp8(v8, vs, self.dtype)], dim=2)
        return self.k_all, self.v_all

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k8, self.k_scale, self.v8, self.v_scale))

    def keep(self, idx: Tensor) -> None:
        raise NotImplementedError("eviction from an FP8 store: evict first, then quantize")


def quantize_cache(cache: Cache, spec: QuantSpec) -> Cache:
    """Store the held tokens of every evicting layer quantized; sliding-window layers stay as they are."""
    kind = Fp8Layer if spec.format == "e4m3" else QuantizedLayer
    return Cache(layers=[kind(layer, spec) if isinstance(layer, EvictingLayer) else layer for layer in cache.layers])


def attention_path(cache: Cache) -> str:
    """How the quantized layers of `cache` attend (see the module's docstring); `dense` when none is quantized."""
    paths = sorted({layer.attention_path for layer in cache.layers if isinstance(layer, (QuantizedLayer, Fp8Layer))})
    return ",".join(paths) or "dense"
