"""Leverage scores: keep the keys that are geometric outliers of their layer, with no attention at all.

Chari & Van Durme 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
(arXiv:2507.08143), its leverage term. A token's statistical leverage is the diagonal of the hat matrix of the
pre-RoPE key matrix X (tokens x channels): l_i = x_i (X^T X)^-1 x_i^T, high for a key that no mix of the others
explains. As the paper and kvpress's LeverageScorePress do, the keys are centred over the sequence and sketched on the
right by a Gaussian matrix (channels x `sketch`, entries N(0, 1 / sketch)), and (X^T X) is regularised by `jitter`
times the identity before its Cholesky factor is taken.

The sketch is a draw: evalkit draws it for layer i from a generator of its own seeded with `seed + i`, on the CPU,
so that a run, a resumed run and a second variant draw the same sketch (kvpress draws from the global generator in
layer order; the peer check seeds it the same way before each layer). The pre-RoPE keys are the held keys rotated
back by their positions with the model's own RoPE (read in `prepare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView
from evalkit.policies.expected_attention import rope, unrotate


def sketch_matrix(shape: tuple[int, ...], seed: int, like: Tensor) -> Tensor:
    """A Gaussian (..., D, sketch) matrix of entries N(0, 1 / sketch), drawn on the CPU from `seed` (the same on every
    device), in `like`'s dtype and device."""
    gen = torch.Generator().manual_seed(seed)
    draw = torch.randn(shape, generator=gen, dtype=like.dtype)
    return (draw * (1 / math.sqrt(shape[-1]))).to(like.device)


def leverage(keys: Tensor, sketch: Tensor, jitter: float) -> Tensor:
    """(B, H, T) approximate leverage of each of the T keys (B, H, T, D): the diagonal of X (X^T X + jitter I)^-1 X^T
    for X the centred keys times `sketch` (B, H, D, k), clamped at 0."""
    x = ((keys - keys.mean(dim=-2, keepdim=True)) @ sketch).float()  # (B, H, T, k)
    gram = x.transpose(-1, -2) @ x
    gram = (gram + gram.transpose(-1, -2)) / 2 + jitter * torch.eye(gram.shape[-1], device=x.device)
    solved = torch.cholesky_solve(x.transpose(-1, -2), torch.linalg.cholesky(gram))  # (X^T X + jI)^-1 X^T
    return (x * solved.transpose(-1, -2)).sum(dim=-1).clamp_min(0)


def z_scored(x: Tensor) -> Tensor:
    """x less its mean over all its entries, over their standard deviation (n - 1), at least 1e-6."""
    return (x - x.mean()) / x.std().clamp_min(1e-6)


@dataclass(kw_only=True)
class Rotary:
    """A policy that reads the pre-RoPE keys: the model's RoPE, read in `prepare`."""

    def read_rope(self, model) -> None:
        self.rope = rope(model)  # (inv_freq, attention scaling); not a field: not recorded, not compared

    def pre_rope_keys(self, view: LayerView, lo: int = 0, hi: int | None = None) -> Tensor:
        """(B, Hkv, hi - lo, D) float32 pre-RoPE keys of the held tokens lo..hi - 1."""
        if not hasattr(self, "rope"):
            raise ValueError(f"{self.name}: the model's RoPE was not read (prepare() was not called)")
        inv_freq, scaling = self.rope
        return unrotate(view.keys[:, :, lo:hi], view.positions[:, :, lo:hi], inv_freq, scaling)


@dataclass(kw_only=True)
class LeverageScore(Rotary, KVPolicy):
    """Per KV head: top-k by the approximate leverage of the pre-RoPE keys."""

    name: str = "leverage"
    sketch: int = 48  # columns of the Gaussian sketch
    jitter: float = 0.01  # added to the sketched Gram matrix's diagonal
    seed: int = 0  # the sketch of layer i is drawn from seed + i
    decode: bool = False

    chunkable: ClassVar[bool] = False  # centred over the whole prompt's keys
    decodable: ClassVar[bool] = False  # a prefill method (kvpress's LeverageScorePress)

    def prepare(self, model, probes) -> dict | None:
        self.read_rope(model)
        return None

    def score(self, view: LayerView) -> Tensor:
        keys = self.pre_rope_keys(view)
        b, h, _, d = keys.shape
        return leverage(keys, sketch_matrix((b, h, d, self.sketch), self.seed + view.layer_idx, keys), self.jitter)

    def check_params(self) -> None:
        check_sketch(self.sketch, self.jitter)


def check_sketch(sketch: int, jitter: float) -> None:
    if sketch < 1:
        raise ParamError({"sketch": sketch}, ": give the sketch's columns, such as 48")
    if not jitter > 0:
        raise ParamError({"jitter": jitter}, ": give a positive regulariser of the Gram matrix, such as 0.01")
