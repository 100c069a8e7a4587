"""Label-free fidelity: how far a compressed cache moves the model's next-token distributions.

Per teacher-forced position: KL(full || compressed), whether the top-1 token agrees, and each cache's negative
log-likelihood of the actual next token, giving the perplexity ratio compressed / full.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def logit_divergence(baseline: list[Tensor], variant: list[Tensor], targets: list[int]) -> dict[str, float]:
    """Metrics of a variant's logits against the baseline's, position by position (targets[j] follows logits[j])."""
    if not targets:
        return {"kl_mean": 0.0, "top1_agreement": 1.0, "ppl_baseline": 1.0, "ppl_variant": 1.0, "ppl_ratio": 1.0}
    base = torch.stack(baseline).log_softmax(-1)  # (M, V)
    var = torch.stack(variant).log_softmax(-1)
    kl = (base.exp() * (base - var)).sum(-1)  # (M,)
    idx = torch.tensor(targets)[:, None]
    nll_base = -base.gather(1, idx).mean().item()
    nll_var = -var.gather(1, idx).mean().item()
    return {
        "kl_mean": kl.mean().item(),
        "top1_agreement": (base.argmax(-1) == var.argmax(-1)).float().mean().item(),
        "ppl_baseline": math.exp(nll_base),
        "ppl_variant": math.exp(nll_var),
        "ppl_ratio": math.exp(nll_var - nll_base),
    }
