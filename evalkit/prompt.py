"""Turn a sample into token ids, split where compression ends.

The prompt is tokenised once, as a whole, and split at the first token that starts at or after the question:
the baseline and every variant therefore see exactly the ids of the joined prompt (no boundary artefacts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from evalkit.tasks import Sample

# query_agnostic: compress the context only, then append the question (a cache reused across questions).
# query_aware: compress the whole prompt, question included, then decode (SnapKV's published setting).
PROTOCOLS = ("query_agnostic", "query_aware")


@dataclass
class Prompt:
    ids: Tensor  # (1, N) the whole prompt
    n_context: int  # ids[:, :n_context] are prefilled and compressed; the rest is appended afterwards
    evidence: list[int]  # absolute positions of the tokens that hold the answer
    protocol: str


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
    enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    n_context = next(i for i, (start, _) in enumerate(offsets) if start >= q_start)
    if protocol == "query_aware":
        n_context = len(offsets) - 1  # all but the last prompt token, whose logits start the answer
    starts = [ctx_start + sample.context.index(e) for e in sample.evidence]
    spans = [(lo, lo + len(e)) for lo, e in zip(starts, sample.evidence, strict=True)]
    evidence = [i for i, (s, e) in enumerate(offsets) if any(s < hi and e > lo for lo, hi in spans)]

    return Prompt(torch.tensor([enc["input_ids"]]), n_context, evidence, protocol)
