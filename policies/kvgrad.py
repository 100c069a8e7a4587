"""KVgrad: KVzip's reconstruction pass, each probe token's attention weighted by how much the model's output depends on
it (input x gradient attribution).

KVgrad (OpenReview cg1wTCJjjk), as kvpress's KVgradPress scores: the context is reconstructed as KVzip reconstructs it
(policies/kvzip.py: a repeat prompt and the context again over the full cache, `chunk_size` tokens per pass, each
softmax over the first `n_sink` keys, the chunk's keys and the pass's own), and the score of cached key c at layer l is

    S = max over probe tokens p and query heads h of its KV group of  A_{p,c} x ||W_O,h v_c||_2 x ||d Phi / d a_p||_2

where A is that attention, ||W_O,h v_c|| the size of what the value writes into the residual stream (KVzip+'s term),
and a_p the layer's attention output at probe p, Phi = sum_p ||h_p||^2 over the last decoder layer's outputs (before the
final norm): the attention a token receives counts as much as the output depends on where it went. The gradients come
from one forward and one backward per chunk over the full cache, read and never written (`gradient_norms`); the
attention and the scores from KVzip's own pass (policies/kvzip_pass.py) with those gradients as the query weights, in
one more forward. Then KVzip's ranking: over all layers and KV heads together, or `layerwise`. Compress once.

Every layer must attend to the whole context (a model with sliding-window layers is refused): the gradient pass runs
transformers' own causal attention over a cache that holds every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from evalkit.attention.observation import Observation
from evalkit.errors import ParamError
from evalkit.policies import Probes, full_attention_only
from evalkit.policies.kvzip import KVzip
from evalkit.policies.kvzip_pass import Block, RawIds, ReadOnlyLayer, pass_inputs, reconstruction_cache, run_pass

TINY = 1e-30  # a gradient norm of 0 weights its probe's attention by 0, kept finite


def gradient_norms(model: torch.nn.Module, full: Cache, ids: Tensor, positions: Tensor, blocks: list[Block]) -> dict:
    """Per layer, (B, L): for every token of the pass inputs `ids` (every chunk's block side by side), the norm of the
    gradient of Phi (the sum of the squared last hidden states of its block) with respect to that layer's attention
    output, each block one forward and one backward over `full` (left unchanged)."""
    decoder = model.get_decoder()
    layers = decoder.layers
    captured: dict[int, Tensor] = {}  # this block's attention outputs, by layer, and its last layer's output (-1)

    def keep(module, args, output) -> None:
        captured[int(module.layer_idx)] = output[0]

    def final(module, args, output) -> None:
        captured[-1] = output[0] if isinstance(output, tuple) else output

    hooks = [layer.self_attn.register_forward_hook(keep) for layer in layers]
    hooks.append(layers[-1].register_forward_hook(final))
    try:
        with torch.inference_mode(False), torch.enable_grad():
            out = {i: torch.zeros(ids.shape[0], ids.shape[1], device=ids.device) for i in range(len(layers))}
            past = [(layer.keys.clone(), layer.values.clone()) for layer in full.layers]  # not inference tensors
            for blk in blocks:
                captured.clear()
                with torch.no_grad():  # the graph starts at the embeddings, not at the embedding table
                    embeds = decoder.embed_tokens(ids[:, blk.start : blk.end].clone())
                embeds.requires_grad_(True)
                cache = Cache(layers=[ReadOnlyLayer(k, v) for k, v in past])
                at = positions[:, blk.start : blk.end]
                decoder(inputs_embeds=embeds, position_ids=at, cache=cache, use_cache=True)
                phi = captured.pop(-1).float().square().sum()
                order = sorted(captured)
                grads = torch.autograd.grad(phi, [captured[i] for i in order])
                for i, g in zip(order, grads, strict=True):
                    out[i][:, blk.start : blk.end] = g.detach().float().norm(dim=-1)
    finally:
        for hook in hooks:
            hook.remove()
    return out


@dataclass(frozen=True)
class GradReconstruction(Observation):
    """Per full-attention layer, (B, Hkv, n_context): KVgrad's scores, KVzip's reconstruction attention weighted by
    the values' output norms and the probes' gradient norms, `chunk` context tokens per pass, `sinks` sink keys."""

    sinks: int
    chunk: int
    pass_name: ClassVar[str] = "kvgrad"

    def second_pass(self, model: torch.nn.Module, full: Cache, context: Tensor, prompt) -> dict[int, Tensor]:
        ids, positions, blocks = pass_inputs(context, prompt or RawIds(), self.chunk)
        cache, scores = reconstruction_cache(full, blocks, self.sinks)
        if not blocks:
            return scores
        norms = gradient_norms(model, full, ids, positions, blocks)
        for i in scores:  # KVzip+'s query divisor, as 1 / the gradient's norm: the probabilities times the norm
            cache.layers[i].hidden_norms = 1.0 / norms[i].clamp(min=TINY)
        run_pass(model, cache, ids, positions)
        return scores


@dataclass(kw_only=True)
class KVgrad(KVzip):
    """KVgrad's scores (KVzip's pass weighted by the gradients), ranked over all layers and KV heads (or per layer), as
    KVzip's are read and ranked; `plus` does not apply (the value term is always there), as kvpress's KVgradPress."""

    name: str = "kvgrad"
    chunk_size: int = 512  # context tokens reconstructed per pass (kvpress's default for KVgrad)

    def needs(self) -> tuple[GradReconstruction]:
        return (GradReconstruction(self.n_sink, self.chunk_size),)

    def prepare(self, model, probes: Probes) -> dict | None:
        full_attention_only(model, "kvgrad", "choose kvzip")
        return None

    def check_params(self) -> None:
        super().check_params()
        if self.plus:
            raise ParamError({"plus": True}, ": kvgrad always weights by the values' output norms; leave it false")
