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

# Score elements per query chunk (64 MiB of float32 scores at most). Chunks of 48 queries of one KV head (its group of
# query heads together) measured fastest on the 2-core CPU at 8k tokens (1.2x SDPA's causal kernel, against 1.35x for
# all heads at once and 2.1x for SDPA plus a second pass): a chunk's scores stay in the caches between the GEMM, the
# softmax (in place), the P @ V product and the column sums.
CHUNK_ELEMENTS = 1 << 24
MAX_QUERIES = 48
MAX_CHUNK = 64  # queries per chunk of attention_mass: 64 measured fastest on CPU at 2k and 8k tokens


def query_chunk(batch: int, heads: int, keys: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Queries per chunk: at most MAX_QUERIES, and at most chunk_elements scores over all heads."""
    return max(1, min(MAX_QUERIES, chunk_elements // max(1, batch * heads * keys)))


def visible_rows(mask: Tensor, hkv: int, group: int) -> Tensor:
    """A boolean or additive mask broadcastable to (B, Hq, Tq, Tk) as (B', Hkv, G, Tq, Tk) booleans, True where
    attended (additive: 0)."""
    rows = mask if mask.dtype == torch.bool else mask == 0
    b, h, tq, tk = rows.shape
    return rows.view(b, 1, 1, tq, tk) if h == 1 else rows.reshape(b, hkv, group, tq, tk)


def attend_with_mass(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scaling: float,
    mask: Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    workspace: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention of query (B, Hq, Tq, D) over key and value (B, Hkv, Tk, D), grouped query heads sharing a
    KV head, and the attention each key receives.

    `mask`: None when the queries are the last Tq keys, causal among themselves (a prefill; one decode step sees
    every key); else a boolean (True: attended) or additive mask broadcastable to (B, Hq, Tq, Tk), as transformers
    gives SDPA. Returns the output as transformers' `sdpa_attention_forward` does, (B, Tq, Hq, D) in the query's
    dtype, and the mass (B, Hkv, Tk) float32: per key, its probabilities summed over the queries and over the query
    heads of its group. Probabilities are computed in float32, one KV head and one chunk of queries at a time.
    `workspace`: a dict that keeps the score buffer and the float32 output from one call to the next (the layers of
    one forward), so that no layer leaves its own between the cache's tensors in the allocator's heap (at 8k tokens
    glibc's heap then grew by about 22 MB a layer more than under SDPA). The output returned is then valid until
    the next call with the same workspace: the next layer's, after this layer's o_proj has read it."""
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    group = hq // hkv
    # the output in its final layout, (B, Tq, Hkv, G, D), each head writing its (G, Tq, D) view: no float32 copy to
    # transpose afterwards unless the model's dtype is not float32
    out = reused(workspace, "out", (b, tq, hkv, group, value.shape[-1]), query.device)
    mass = torch.zeros(b, hkv, tk, dtype=torch.float32, device=key.device)
    queries = query.view(b, hkv, group, tq, d)
    visible = None if mask is None else visible_rows(mask, hkv, group)
    chunk = min(tq, query_chunk(1, group, tk, chunk_elements))
    scratch = reused(workspace, "scores", (group * chunk * tk,), query.device, grow=True)  # for every chunk
    for i in range(b):
        for h in range(hkv):
            rows = None if visible is None else visible[min(i, visible.shape[0] - 1), min(h, visible.shape[1] - 1)]
            head = (queries[i, h], key[i, h].float(), value[i, h].float())
            one_head(head, scaling, rows, scratch, chunk, out[i, :, h].transpose(0, 1), mass[i, h])
    output = out.view(b, tq, hq, -1).to(query.dtype)
    return output, mass


def reused(
    workspace: dict[str, Tensor] | None, name: str, shape: tuple[int, ...], device: torch.device, grow: bool = False
) -> Tensor:
    """A float32 buffer of `shape`: the workspace's `name` when it fits (`grow`: a flat buffer of at least that many
    elements), else a new one, kept there for the next call. No workspace, or autograd recording: always a new one
    (a tensor an earlier layer's graph saved is never written over)."""
    if workspace is None or torch.is_grad_enabled():
        return torch.empty(shape, dtype=torch.float32, device=device)
    held = workspace.get(name)
    if held is not None and held.device == device:
        if grow and held.numel() >= shape[0]:
            return held[: shape[0]]
        if held.shape == shape:
            return held
    workspace[name] = torch.empty(shape, dtype=torch.float32, device=device)
    return workspace[name]


def one_head(
    head: tuple[Tensor, Tensor, Tensor],
    scaling: float,
    visible: Tensor | None,
    scratch: Tensor,
    chunk: int,
    out: Tensor,
    mass: Tensor,
) -> None:
    """`attend_with_mass` for one KV head: queries (G, Tq, D), scaled chunk by chunk in float32 (one chunk's copy,
    never the head's), keys and values (Tk, D) float32; writes the output (G, Tq, D) into `out` (a view of the
    output in its final layout) and adds the column sums of the probabilities into `mass` (Tk,). `visible`:
    (G or 1, Tq, Tk) booleans, or None for causal queries that are the last Tq keys."""
    queries, keys, values = head
    group, tq, d = queries.shape
    tk = keys.shape[0]
    past = tk - tq
    keys_t = keys.t()
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=keys.device).triu(1)
    for start in range(0, tq, chunk):
        end = min(start + chunk, tq)
        n = end - start
        seen = past + end if visible is None else tk  # causal: keys after the chunk's last query take no share
        probs = scratch[: group * n * seen].view(group * n, seen)
        rows = (queries[:, start:end].float() * scaling).reshape(group * n, d)
        torch.matmul(rows, keys_t[:, :seen], out=probs)
        if visible is None:  # only the chunk's own diagonal block is masked: query i sees keys up to past + i
            probs.view(group, n, seen)[..., past + start :].masked_fill_(upper[:n, :n], float("-inf"))
        else:
            probs.view(group, n, seen).masked_fill_(~visible[:, start:end], float("-inf"))
        torch.softmax(probs, dim=-1, out=probs)  # in place: the scores are not needed again
        out[:, start:end] = (probs @ values[:seen]).view(group, n, -1)
        mass[:seen] += probs.sum(dim=0)


def attention_mass(query: Tensor, key: Tensor, scaling: float, chunk_elements: int = CHUNK_ELEMENTS) -> Tensor:
    """(B, Hkv, Tk) attention each key receives from the queries (the last Tq keys), summed over queries and
    over the query heads of its KV group. Chunked over queries: memory O(chunk x Tk), never O(Tq x Tk); each chunk
    multiplies only the keys it can see, so the masked upper triangle costs nothing."""
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    group, past = hq // hkv, tk - tq
    chunk = max(1, min(MAX_CHUNK, chunk_elements // (b * hq * tk)))
    q = query.view(b, hkv, group, tq, d)  # the query heads of each KV group side by side
    keys_t = key.float().transpose(-1, -2)  # (B, Hkv, D, Tk)
    mass = torch.zeros(b, hkv, tk, dtype=torch.float32, device=key.device)
    for start in range(0, tq, chunk):
        end = min(start + chunk, tq)
        seen = past + end  # keys visible to the chunk's last query
        rows = (q[:, :, :, start:end].float() * scaling).reshape(b, hkv, group * (end - start), d)
        scores = rows @ keys_t[..., :seen]  # (B, Hkv, G*c, seen)
        visible = torch.arange(seen, device=key.device) <= past + torch.arange(start, end, device=key.device)[:, None]
        scores.masked_fill_(~visible.repeat(group, 1), float("-inf"))
        mass[..., :seen] += scores.softmax(dim=-1).sum(dim=2)
    return mass
