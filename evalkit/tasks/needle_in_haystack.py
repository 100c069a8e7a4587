"""Needle in a haystack over Paul Graham's essays (Kamradt, 2023, "Needle In A Haystack - Pressure Testing LLMs";
kvpress's evaluation/benchmarks/needle_in_haystack on `alessiodevoto/paul_graham_essays`).

The needle (the dataset's `needle` column) is inserted into the essay at each depth (percent of the context, in
tokens) of a context cut to `context_length` tokens less the needle and 150 tokens of room, as kvpress's
insert_needle_in_haystack does, and wrapped in "This is a very long story book: <book> {context} </book>.".
Score: ROUGE-L recall of the needle in the prediction (evalkit.scoring.needle_in_haystack).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

WRAPPER = "This is a very long story book: <book> {context} </book>."
ROOM = 150  # tokens kvpress leaves for the template and the question


def insert(
    tokenizer: PreTrainedTokenizerBase, context: str, needle: str, context_length: int, depth: float
) -> tuple[str, int]:
    """The essay cut to fit `context_length` tokens with the needle inserted at `depth` percent of it, and the
    length the cell is labelled with: `context_length` when the essay fills it, else the tokens it gave (essay and
    needle, plus the ROOM kvpress leaves), so that a short essay is not reported at a length it never reached."""
    needle_ids = tokenizer.encode(needle, add_special_tokens=False)
    room = context_length - len(needle_ids) - ROOM
    ids = tokenizer.encode(context, add_special_tokens=False)[:room]
    at = int(len(ids) * depth / 100)
    text = WRAPPER.format(context=tokenizer.decode(ids[:at] + needle_ids + ids[at:], skip_special_tokens=True))
    return text, context_length if len(ids) >= room else len(ids) + len(needle_ids) + ROOM
