"""How closely a variant's next-token distributions follow the baseline's while both answer the same sample.

A distribution is comparable only where both decodes had generated the same tokens so far: the first answer position,
and each one after tokens they agreed on, up to and including the first one they chose differently. Top-1 agreement
is the share of those positions where the variant's most likely token is the baseline's; KL(baseline || variant) is
in nats. In-process engines give the full vocabulary; a server gives its top-k log-probabilities, so KL is taken over
the tokens both returned, each distribution renormalized on them (a lower bound of nothing: a different quantity,
labelled by `support`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def shared_positions(base: Sequence, tokens: Sequence) -> int:
    """How many answer positions both decodes reached with the same tokens before them."""
    n = 0
    for a, b in zip(base, tokens, strict=False):
        n += 1
        if a != b:
            break
    return n


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - math.log(np.exp(x).sum())


def full_vocabulary(
    base_logits: Sequence[np.ndarray], logits: Sequence[np.ndarray], base_tokens: Sequence, tokens: Sequence
) -> dict[str, Any]:
    """Fidelity over the whole vocabulary from each position's logits (in-process engines)."""
    n = shared_positions(base_tokens, tokens)
    top1, kl = [], []
    for p_logits, q_logits in zip(base_logits[:n], logits[:n], strict=True):
        lp, lq = _log_softmax(p_logits), _log_softmax(q_logits)
        top1.append(float(np.argmax(p_logits) == np.argmax(q_logits)))
        kl.append(float(np.sum(np.exp(lp) * (lp - lq))))
    return _summary(n, top1, kl, "full vocabulary")


def top_tokens(
    base_top: Sequence[dict[str, float]], top: Sequence[dict[str, float]], base_tokens: Sequence, tokens: Sequence
) -> dict[str, Any]:
    """Fidelity from the top-k log-probabilities a server returned at each position (token text -> logprob)."""
    n = shared_positions(base_tokens, tokens)
    top1, kl, support = [], [], []
    for p, q in zip(base_top[:n], top[:n], strict=True):
        top1.append(float(max(p, key=p.get) == max(q, key=q.get)))
        both = sorted(set(p) & set(q))
        support.append(len(both))
        if both:
            lp = np.array([p[t] for t in both]) - _logsumexp([p[t] for t in both])
            lq = np.array([q[t] for t in both]) - _logsumexp([q[t] for t in both])
            kl.append(float(np.sum(np.exp(lp) * (lp - lq))))
    k = max((len(p) for p in base_top), default=0)
    out = _summary(n, top1, kl, f"top-{k} tokens returned by both servers, renormalized")
    out["tokens_compared"] = sum(support) / len(support) if support else None
    return out


def _logsumexp(values: list[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def _summary(n: int, top1: list[float], kl: list[float], support: str) -> dict[str, Any]:
    return {
        "positions": n,
        "top1_agreement": sum(top1) / len(top1) if top1 else None,
        "kl_mean": sum(kl) / len(kl) if kl else None,
        "support": support,
    }
