"""Turn a sample into token ids, split where compression ends.

The prompt is tokenised once, as a whole, and split at the first token that starts at or after the question:
the baseline and every variant therefore see exactly the ids of the joined prompt (no boundary artefacts).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from evalkit.tasks import Sample

# query_agnostic: compress the context only, then append the question (a cache reused across questions).
# query_aware: compress the whole prompt, question included, then decode (SnapKV's published setting).
PROTOCOLS = ("query_agnostic", "query_aware")


# KVzip's repeat prompts (kvpress KVzipPress), for the first chunk of the context and for each later one
REPEAT = "\n\nRepeat the previous context exactly."
REPEAT_PART = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class Repeat:
    """The prompt's parts a policy's second pass reads (evalkit.attention.observation): the ids of KVzip's
    reconstruction prompt (policies/kvzip.py), whose pass over chunk [lo, hi) of the prefilled context reads `first`
    (or `part` and the previous chunk's last 8 ids), `suffix` (the chat template's end of the user turn and start of
    the assistant's), then ids[lo:hi]; and how many of the context's last ids are the question (Finch's window,
    policies/finch.py). The default (no text: a prompt made from raw ids) reconstructs every prefilled token with no
    instruction, and its context holds no question."""

    start: int = 0  # ids[:, :start] are the template's opening (system turn, user header): not reconstructed
    first: list[int] = field(default_factory=list)
    part: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)
    question: int = 0  # the context's last `question` ids are the question (query_aware); 0: it holds none


@dataclass
class Prompt:
    ids: Tensor  # (1, N) the whole prompt
    n_context: int  # ids[:, :n_context] are prefilled and compressed; the rest is appended afterwards
    evidence: list[int]  # absolute positions of the tokens that hold the answer
    protocol: str
    repeat: Repeat | None = None  # KVzip's reconstruction prompt (build_prompt sets it); None: Repeat()
    n_document: int | None = None  # ids[:, :n_document] come before the question (None: n_context, as query_agnostic)

    @property
    def context_ids(self) -> bytes:
        """The ids this prompt prefills and compresses: prompts with the same ones share one prefill and compression
        (several questions on one context)."""
        return self.ids[0, : self.n_context].cpu().numpy().tobytes()

    @property
    def context_id(self) -> str:
        """Names the compressed context in every row (16 hex digits of the sha256 of its ids): the unit of evidence,
        shared by the questions answered from one prefill."""
        return context_digest(self.context_ids)

    @property
    def document_id(self) -> str:
        """Names the document in every row: the digest of the ids before the question, the same for every question
        on one document whatever the protocol (query_aware compresses each question with it, so its context_id
        differs per question). Questions on one document share its fate: the gate's unit."""
        n = self.n_context if self.n_document is None else self.n_document
        return context_digest(self.ids[0, :n].cpu().numpy().tobytes())


def context_digest(ids: bytes) -> str:
    """16 hex digits of the sha256 of a context's token ids (as int64 bytes)."""
    return hashlib.sha256(ids).hexdigest()[:16]


def prompt_text(tokenizer: PreTrainedTokenizerBase, sample: Sample) -> tuple[str, int, bool]:
    """The prompt as text, where its question part starts, and whether it came from the chat template.

    With a chat template, context and question share one user turn; otherwise a plain Question/Answer frame.
    Either way the sample's answer prefix opens the answer.
    """
    if sample.continuation:  # plain text: the context, then its continuation
        return sample.context + sample.continuation, len(sample.context), False
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": f"{sample.context}\n\n{sample.question}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ctx_end = text.index(sample.context) + len(sample.context)
        return text + sample.answer_prefix, text.index(sample.question, ctx_end), True
    text = f"{sample.context}\n\nQuestion: {sample.question}\nAnswer: {sample.answer_prefix}".rstrip()
    return text, len(sample.context) + 2, False


def build_prompt(tokenizer: PreTrainedTokenizerBase, sample: Sample, protocol: str = "query_agnostic") -> Prompt:
    text, q_start, chat = prompt_text(tokenizer, sample)
    ctx_start = text.index(sample.context)
    # A chat template already writes the special tokens it needs; a plain prompt gets the tokenizer's BOS.
    ids, offsets = encode(tokenizer, text, user_spans(text, sample, ctx_start), add_special_tokens=not chat)
    n_document = next(i for i, (start, _) in enumerate(offsets) if start >= q_start)
    n_context = n_document
    if protocol == "query_aware":
        n_context = len(offsets) - 1  # all but the last prompt token, whose logits start the answer
    starts = [ctx_start + sample.context.index(e) for e in sample.evidence]
    spans = [(lo, lo + len(e)) for lo, e in zip(starts, sample.evidence, strict=True)]
    evidence = [i for i, (s, e) in enumerate(offsets) if any(s < hi and e > lo for lo, hi in spans)]

    start = next((i for i, (s, _) in enumerate(offsets) if s >= ctx_start), n_context)
    repeat = dataclasses.replace(repeat_prompt(tokenizer, chat, start), question=n_context - n_document)
    return Prompt(torch.tensor([ids]), n_context, evidence, protocol, repeat, n_document)


def repeat_prompt(tokenizer: PreTrainedTokenizerBase, chat: bool, start: int) -> Repeat:
    """KVzip's reconstruction prompt for a context whose first token is `start`, tokenised as kvpress does: the
    instruction as text (no special tokens) and, in a chat prompt, the template's text between the end of the user's
    message and the assistant's answer ("\n" without a template)."""
    suffix = "\n"
    if chat:
        mark = "\x00evalkit-user-message\x00"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True
        )
        suffix = text[text.index(mark) + len(mark) :]

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return Repeat(start, ids(REPEAT), ids(REPEAT_PART), ids(suffix))


def user_spans(text: str, sample: Sample, ctx_start: int) -> list[tuple[int, int]]:
    """(start, end) of the sample's own text in the prompt: context, question, continuation, answer prefix."""
    spans, end = [(ctx_start, ctx_start + len(sample.context))], ctx_start + len(sample.context)
    for part in (sample.question, sample.continuation, sample.answer_prefix.strip()):
        if part:
            lo = text.index(part, end)
            spans.append((lo, lo + len(part)))
            end = lo + len(part)
    return spans


def encode(
    tokenizer: PreTrainedTokenizerBase, text: str, spans: list[tuple[int, int]], add_special_tokens: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text`, where the characters in `spans` (the data's text) are tokenised
    as text: a special token's string in the data (`<|im_end|>`, `<|im_start|>`) never becomes a control token,
    so a sample cannot forge conversation turns. Text without such strings is tokenised whole, in one call."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    control = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if not any(
        i in control and any(lo <= s and e <= hi for lo, hi in spans) for i, (s, e) in zip(ids, offsets, strict=True)
    ):
        return ids, offsets
    # Tokenise piece by piece: the template's text as it is, the data's text with special tokens split.
    ids = tokenizer("", add_special_tokens=add_special_tokens)["input_ids"]  # the BOS a plain prompt opens with
    offsets = [(0, 0)] * len(ids)
    cuts = sorted({0, len(text), *(c for span in spans for c in span)})
    for lo, hi in pairwise(cuts):
        data = any(a <= lo and hi <= b for a, b in spans)
        piece = tokenizer(text[lo:hi], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=data)
        ids += piece["input_ids"]
        offsets += [(lo + s, lo + e) for s, e in piece["offset_mapping"]]
    return ids, offsets
