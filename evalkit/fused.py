"""Attention and what a policy observes in it, from one set of probabilities per query chunk.

H2O's score is the attention mass each key receives: the column sums of the very softmax that weights the values.
Computing the output with SDPA and the mass in a second QK^T pass costs two passes over the scores; here each chunk of
queries computes its scores once, turns them into probabilities once, and takes from them both the output (P @ V) and
the mass (the column sums of P). Memory stays bounded by the chunk: one (rows x keys) score buffer, reused, never the
(Tq x Tk) matrix. On the CPU this is the fast path (the second pass is gone); on a GPU the lever is a fused kernel
(kernels/attention_mass.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Score elements per query chunk (64 MiB of float32 scores at most, two buffers). Chunks of about 32 queries per head
# measured fastest on the 2-core CPU at 2k and 8k tokens: the scores of one chunk stay in the L2/L3 caches between
# the softmax, the P @ V product and the column sums.
CHUNK_ELEMENTS = 1 << 24
MAX_QUERIES = 32


def query_chunk(batch: int, heads: int, keys: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Queries per chunk: at most MAX_QUERIES, and at most chunk_elements scores over all heads."""
    return max(1, min(MAX_QUERIES, chunk_elements // max(1, batch * heads * keys)))


def visible_rows(mask: Tensor, start: int, end: int, hkv: int, group: int) -> Tensor:
    """The rows [start, end) of a boolean or additive mask broadcastable to (B, Hq, Tq, Tk), as (B', Hkv, G*n, Tk)
    booleans (True: attended) laid out like the grouped score rows."""
    rows = mask[..., start:end, :]
    if rows.dtype != torch.bool:  # additive: 0 where attended
        rows = rows == 0
    b, h, n, tk = rows.shape
    if h == 1:
        return rows.view(b, 1, n, tk).expand(b, hkv, n, tk).repeat(1, 1, group, 1)
    return rows.reshape(b, hkv, group * n, tk)


def attend_with_mass(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scaling: float,
    mask: Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """Softmax attention of query (B, Hq, Tq, D) over key and value (B, Hkv, Tk, D), grouped query heads sharing a
    KV head, and the attention each key receives.

    `mask`: None when the queries are the last Tq keys, causal among themselves (a prefill; one decode step sees
    every key); else a boolean (True: attended) or additive mask broadcastable to (B, Hq, Tq, Tk), as transformers
    gives SDPA. Returns the output as transformers' `sdpa_attention_forward` does, (B, Tq, Hq, D) in the query's
    dtype, and the mass (B, Hkv, Tk) float32: per key, its probabilities summed over the queries and over the query
    heads of its group. Probabilities are computed in float32."""
    b, hq, tq, d = query.shape
    hkv, tk, dv = key.shape[1], key.shape[2], value.shape[-1]
    group, past = hq // hkv, tk - tq
    chunk = query_chunk(b, hq, tk, chunk_elements)
    q = query.view(b, hkv, group, tq, d)
    keys_t = key.float().transpose(-1, -2)  # (B, Hkv, D, Tk)
    values = value.float()
    out = torch.empty(b, hkv, group, tq, dv, dtype=torch.float32, device=query.device)
    mass = torch.zeros(b, hkv, tk, dtype=torch.float32, device=key.device)
    # Two scratch buffers reused by every chunk: fresh allocations of this size cost page faults on every chunk.
    scores_buf = torch.empty(b * hkv * group * chunk * tk, dtype=torch.float32, device=query.device)
    probs_buf = torch.empty_like(scores_buf)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=query.device).triu(1)
    for start in range(0, tq, chunk):
        end = min(start + chunk, tq)
        n = end - start
        seen = past + end if mask is None else tk  # causal: keys after the chunk's last query take no share
        shape = (b, hkv, group * n, seen)
        scores = scores_buf[: b * hkv * group * n * seen].view(shape)
        rows = (q[:, :, :, start:end].float() * scaling).reshape(b, hkv, group * n, d)
        torch.matmul(rows, keys_t[..., :seen], out=scores)
        if mask is None:  # only the chunk's own diagonal block is masked: query i sees keys up to past + i
            scores.view(b, hkv, group, n, seen)[..., past + start :].masked_fill_(upper[:n, :n], float("-inf"))
        else:
            scores.masked_fill_(~visible_rows(mask, start, end, hkv, group), float("-inf"))
        probs = probs_buf[: scores.numel()].view(shape)
        torch.softmax(scores, dim=-1, out=probs)
        out[:, :, :, start:end] = (probs @ values[..., :seen, :]).view(b, hkv, group, n, dv)
        mass[..., :seen] += probs.sum(dim=2)
    output = out.view(b, hq, tq, dv).transpose(1, 2).to(query.dtype).contiguous()
    return output, mass
