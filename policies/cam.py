"""CaM: an inner scorer's choice while decoding, each evicted value merged by chance into the kept tokens after it.

Zhang et al. 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference" (ICML; openreview LCTmppB165), as
kvpress's CAMPress applies it to a decode: every `decode_interval` forwards the cache is brought back to `budget`
tokens. The inner scorer's scores, averaged over the KV heads, choose one set of tokens for every head. Each evicted
token i is then merged, in each KV head, into its window: the `merge_budget` kept tokens after it in position order
(fewer at the end). With probability min(1, A_i / mean over the window of A_j), A the attention each token has received
from the decoded tokens since the prompt (averaged over the query heads of its KV head; `DecodeAttention`), a Bernoulli
draw decides whether v_i / (window size) is added to every value of the window; keys are unchanged. The draws come
from a generator seeded by `seed`, the layer and the tokens seen, so a sample's merges do not depend on the samples
before it (a resumed run draws what an unbroken one drew); `seed: null` draws from torch's global generator, as
kvpress's CAMPress does (the peer check seeds both sides alike).

kvpress's CAMPress never compresses the prompt; here an eviction after the prompt (a budget below the prompt) keeps the
inner scorer's choice and merges nothing (no token has received decoding attention yet: every probability is 0/0,
which kvpress counts as no merge). kvpress merges the `k` best-scoring evicted tokens, k the forwards since its last
compression; as the cache held at most its target then, every evicted token arrived since, so k covers them all here.
The merged tokens are the n lowest-scoring by their own top-k, as kvpress picks them: where scores tie at the budget's
edge (a repeated token's equal key norms) that may name a kept token and leave an evicted one unmerged, as in kvpress.
A forward of several tokens (a question fed at once) adds the attention of its last token alone, as kvpress's CAMPress
reads a forward (the softmax of the last query over every key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from evalkit.attention.observation import Attended, Observation
from evalkit.errors import ParamError
from evalkit.policies import LayerView, Wrapper, checked_scores, gather_tokens


@dataclass(frozen=True)
class DecodeAttention(Observation):
    """Per held token: the attention it has received from the tokens decoded after the prompt, summed over the
    forwards (a forward of several tokens: its last token's) and averaged over the query heads of its KV head (zero
    for every token at the prompt's end)."""

    per_token: ClassVar[bool] = True
    wants_mass: ClassVar[bool] = True

    def prefill(self, at: Attended) -> Tensor:
        return at.key.new_zeros(at.key.shape[:3], dtype=torch.float32)

    def step(self, held: Tensor, at: Attended) -> Tensor:
        b, hq, q, _ = at.query.shape
        hkv, tk = at.key.shape[1], at.key.shape[2]
        group = hq // hkv
        if q == 1:
            return held + at.mass.float() / group
        # several tokens in one forward (a question fed at once): the last one's attention alone, over every key it
        # sees (all of them), as kvpress's CAMPress reads a forward
        keys = at.key.float().repeat_interleave(group, dim=1)
        probs = ((at.query[:, :, -1:].float() * at.scaling) @ keys.transpose(-1, -2)).softmax(dim=-1)  # (B, Hq, 1, Tk)
        return held + probs.view(b, hkv, group, tk).sum(dim=2) / group


def merged_into_windows(
    values: Tensor,
    attention: Tensor,
    kept: Tensor,
    window: int,
    evicted: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """(B, Hkv, k, D) the kept tokens' values with each evicted token's merged into the `window` kept tokens after it
    by a Bernoulli draw per KV head (the module doc); `kept` (B, Hkv, k) ascending, the same tokens in every head;
    `evicted` (B, n) ascending, the tokens merged (None: those not kept)."""
    b, h, t, d = values.shape
    k = kept.shape[-1]
    kept_v = gather_tokens(values, kept).float()
    if k in (0, t):
        return kept_v.to(values.dtype)
    order = kept[:, 0]  # (B, k): every head keeps the same tokens
    if evicted is None:
        evicted = torch.ones(b, t, dtype=torch.bool, device=values.device).scatter(-1, order, False)
        evicted = evicted.nonzero()[:, 1].view(b, t - k)  # (B, n) ascending
    starts = torch.searchsorted(order, evicted, right=True)  # the first kept token after each evicted one
    slots = starts[..., None] + torch.arange(window, device=values.device)  # (B, n, window), slots into the kept
    valid = slots < k
    slots = slots.clamp(max=k - 1)
    size = valid.sum(dim=-1)  # (B, n) the window's tokens
    kept_attention = gather_tokens(attention.float(), kept)  # (B, Hkv, k)
    in_window = kept_attention.gather(2, slots.view(b, 1, -1).expand(-1, h, -1)).view(b, h, -1, window)
    mean = (in_window * valid[:, None]).sum(dim=-1) / size.clamp(min=1)[:, None]  # (B, Hkv, n)
    chance = attention.float().gather(2, evicted[:, None].expand(-1, h, -1)) / mean
    chance = torch.where(torch.isnan(chance), torch.zeros_like(chance), chance)
    chance = torch.where(torch.isinf(chance), torch.ones_like(chance), chance).clamp(0, 1).contiguous()
    merged = torch.bernoulli(chance, generator=generator)  # (B, Hkv, n): kvpress's shape and order
    scale = torch.where(size[:, None] == 0, torch.zeros_like(merged), merged / size[:, None].clamp(min=1))
    moved = gather_tokens(values, evicted[:, None].expand(-1, h, -1)).float() * scale[..., None]  # (B, Hkv, n, D)
    moved = (moved[:, :, :, None] * valid[:, None, :, :, None]).reshape(b, h, -1, d)
    added = torch.zeros_like(kept_v).scatter_add(2, slots.reshape(b, 1, -1, 1).expand(-1, h, -1, d), moved)
    return (kept_v + added).to(values.dtype)


@dataclass(kw_only=True)
class CaM(Wrapper):
    """While decoding, the inner scorer's choice averaged over KV heads; evicted values merged into the kept tokens
    after them by chance."""

    name: str = "cam"
    merge_budget: int = 32
    seed: int | None = 0  # None: torch's global generator (kvpress's)
    decode: bool | None = True

    def needs(self) -> tuple[Observation, ...]:
        return (*self.inner.needs(), DecodeAttention())

    @property
    def chunkable(self) -> bool:  # type: ignore[override]
        return False  # it acts while decoding; a chunked prefill's evictions would merge nothing: use its inner policy

    def score(self, view: LayerView) -> Tensor:
        return self.inner.score(view).float().mean(dim=1, keepdim=True).expand(view.keys.shape[:3])

    def select(self, view: LayerView, k: int) -> Tensor:
        """The k best by the scores averaged over the KV heads, one top-k for all heads (as kvpress ranks, ties
        included); the inner policy's protected tokens are not kept first, as CAMPress ranks by the scores alone."""
        scores = checked_scores(self, self.score(view), view)[:, 0]  # (B, T)
        return scores.topk(k, dim=-1).indices.sort(dim=-1).values[:, None].expand(-1, view.keys.shape[1], -1)

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor]:
        generator = None
        if self.seed is not None:  # one stream per sample, layer and eviction
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + view.layer_idx * 10_007 + view.seen)
        # the merged: the n lowest scores by their own top-k, as kvpress picks them; on a tie at the budget's edge
        # (a repeated token's equal key norms) that may name a kept token instead of an evicted one, as in kvpress
        n = view.keys.shape[2] - kept.shape[-1]
        lowest = self.score(view)[:, 0].topk(n, dim=-1, largest=False).indices.sort(dim=-1).values
        attention = view.observed(DecodeAttention())
        values = merged_into_windows(view.values, attention, kept, self.merge_budget, lowest, generator)
        return gather_tokens(view.keys, kept), values

    def check_params(self) -> None:
        super().check_params()
        if self.merge_budget < 1:
            raise ParamError({"merge_budget": self.merge_budget}, ": merge into at least 1 kept token, e.g. 32")
