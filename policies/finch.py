"""Finch: SnapKV's scores with the question as the window, each query's attention weighed by the keys it sees, and the
kept keys re-rotated to contiguous positions.

Corallo and Papotti 2024, "FINCH: Prompt-guided Key-Value Cache Compression" (TACL), as kvpress's FinchPress applies
it: the window is the question, the prompt's tokens after the document
(kvpress finds them by a delimiter token the user inserts; evalkit knows where the question starts). Each question
query's softmax over the context and the question before it is multiplied by its position (kvpress's normalisation,
`normalize`: a later query spreads its attention over more keys), averaged over the question's queries and over the
query heads of a KV group; no pooling. The question's tokens score above every document token (kvpress pads them with
the layer's highest score plus one), so they are kept first. With `rerotate` (kvpress's default) the kept keys are
re-rotated to slots 0 .. k-1 as policies/key_rerotation.py does, and the answer continues from k.

It needs a question inside the compressed context: `protocol=query_aware` on a task whose samples have one (with
query_agnostic the context holds none: the run is refused in one line before the model loads, and a context
without one (a prompt of raw ids) when its pass runs). The question's queries are computed
again by this policy's own pass (`QuestionAttention`): the question's ids read over the prefilled document, read in
place. Every layer must attend to the whole context (sliding-window models are refused).

`chunk_length` (kvpress's setting of the same name; null, its default: one top-k over the prompt): the same scores,
kept by a top-k within each chunk of `chunk_length` tokens of the prompt, each chunk keeping its share of the k tokens
in proportion to its length (policies/chunk.py's `shares`: floor(k x len / T), the leftover to the largest
remainders, so that the shares add up to k; kvpress keeps floor(len x (1 - ratio)) a chunk, the same counts whenever
they add up to k). Unlike `chunk` over another policy, the scores are the whole prompt's, not each chunk's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from evalkit.attention.observation import Attended, Observation
from evalkit.attention.sdpa import observe
from evalkit.errors import ConfigError, ParamError
from evalkit.policies import KVPolicy, LayerView, Probes, checked_scores, full_attention_only
from evalkit.policies.chunk import shares
from evalkit.policies.key_rerotation import rerotated_tokens, rotary_frequencies
from evalkit.policies.kvzip_pass import READ_CHUNK, ReadOnlyLayer, pass_probs


@dataclass
class QuestionScores:
    """The question's attention recorder: per layer, (B, Hkv, n - q) each document token's score."""

    document: int  # n - q: the tokens before the question
    normalize: bool
    got: dict[int, Tensor] = field(default_factory=dict)

    def wants_mass(self, layer_idx: int, layer) -> bool:
        return False

    def record(self, layer_idx: int, layer, at: Attended) -> None:
        b, hq, q, _ = at.query.shape
        hkv = at.key.shape[1]
        keys = at.key.float().repeat_interleave(hq // hkv, dim=1)  # (B, Hq, n, D)
        total = torch.zeros(b, hq, self.document, device=at.query.device)
        for start in range(0, q, READ_CHUNK):  # question query i, at position document + i, sees keys up to its own
            end = min(start + READ_CHUNK, q)
            probs = pass_probs(at, keys, start, end)[..., : self.document]  # (B, Hq, c, n - q)
            if self.normalize:  # kvpress: each query's weights times its position
                probs = probs * torch.arange(self.document + start, self.document + end, device=probs.device)[:, None]
            total = total + probs.sum(dim=2)
        self.got[layer_idx] = (total / q).view(b, hkv, hq // hkv, self.document).mean(dim=2)


@dataclass(frozen=True)
class QuestionAttention(Observation):
    """Per layer, (B, Hkv, n - q): each document token's attention from the question's q queries (the context's last
    ids, `Repeat.question`), read again over the prefilled document; `normalize`: each query's weighed by its
    position."""

    normalize: bool = True
    pass_name: ClassVar[str] = "question"

    @torch.inference_mode()
    def second_pass(self, model: torch.nn.Module, full: Cache, context: Tensor, prompt) -> dict[int, Tensor]:
        n, q = context.shape[1], getattr(prompt, "question", 0)
        if not 0 < q < n:
            raise ConfigError(
                "finch scores the context by its question's attention, and this context holds no question "
                f"({q} of its {n} tokens): run it with protocol=query_aware on a task whose samples ask one"
            )
        recorder = QuestionScores(n - q, self.normalize)
        cache = Cache(
            layers=[ReadOnlyLayer(layer.keys[:, :, : n - q], layer.values[:, :, : n - q]) for layer in full.layers]
        )
        positions = torch.arange(n - q, n, device=context.device)[None]
        model(
            input_ids=context[:, n - q :],
            position_ids=positions,
            cache=cache,
            logits_to_keep=1,
            **observe(recorder, cache),
        )
        return recorder.got


@dataclass(kw_only=True)
class Finch(KVPolicy):
    """Top-k by the question's position-weighed attention; the question always first; kept keys re-rotated."""

    name: str = "finch"
    normalize: bool = True
    rerotate: bool = True
    chunk_length: int | None = None
    decode: bool = False

    chunkable: ClassVar[bool] = False  # its window is the question, which only the whole prompt holds
    decodable: ClassVar[bool] = False  # and a re-rotated key cannot be re-rotated again
    reads_question: ClassVar[bool] = True

    def needs(self) -> tuple[QuestionAttention]:
        return (QuestionAttention(self.normalize),)

    def prepare(self, model, probes: Probes) -> dict | None:
        full_attention_only(model, self.name, "choose snapkv (query_aware) for a model with sliding-window layers")
        if self.rerotate:
            self.inv_freq = rotary_frequencies(model, self.name)  # not a field: not recorded, not compared
        return None

    def score(self, view: LayerView) -> Tensor:
        document = view.observed(QuestionAttention(self.normalize))  # (B, Hkv, n - q)
        b, h, d = document.shape
        question = document.new_full((b, h, view.keys.shape[2] - d), float(document.max()) + 1)
        return torch.cat([document, question], dim=-1)

    def select(self, view: LayerView, k: int) -> Tensor:
        if self.chunk_length is None:
            return super().select(view, k)
        scores = checked_scores(self, self.score(view), view)
        t = scores.shape[-1]
        starts = range(0, t, self.chunk_length)
        lengths = [min(self.chunk_length, t - s) for s in starts]
        kept = [
            start + scores[..., start : start + n].topk(k_c, dim=-1, sorted=False).indices
            for start, n, k_c in zip(starts, lengths, shares(k, lengths), strict=True)
            if k_c
        ]
        return torch.cat(kept, dim=-1).sort(dim=-1).values

    def check_params(self) -> None:
        super().check_params()
        if self.chunk_length is not None and self.chunk_length < 1:
            raise ParamError(
                {"chunk_length": self.chunk_length},
                ": give a chunk of tokens such as 256, or null for one top-k over the whole prompt",
            )

    def continues_from_held(self) -> bool:
        return self.rerotate

    def rewrite(self, view: LayerView, kept: Tensor) -> tuple[Tensor, Tensor] | None:
        if not self.rerotate:
            return None
        return rerotated_tokens(view, kept, getattr(self, "inv_freq", None), self.name)
