"""DuoAttention: retrieval heads keep the whole cache, streaming heads only the attention sinks and recent tokens.

Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads"
(arXiv:2410.10819). Each KV head of a full-attention layer has a role. A retrieval head keeps every token; a streaming
head keeps the first `sink` tokens and the `recent` most recent ones, after the prompt and after every decode step
(the paper's defaults: 64 sinks, 256 recent tokens; kvpress's DuoAttentionPress reads them from the pattern's
config). `budget` is the fraction of KV heads that stay retrieval heads (1.0: all of them, the full cache); the
tokens held follow from it, about budget + (1 - budget) x (sink + recent) / T of a T-token context. An int budget is
refused: the method has no token budget.

Head roles come from scores, one per (layer, KV head), higher = more a retrieval head; the lowest-scored
`round((1 - budget) x heads)` heads over the whole model stream (as kvpress's DuoAttentionPress ranks them):

- `pattern`: a file in the paper's format (`full_attention_heads.tsv` of mit-han-lab/duo-attention's attn_patterns:
  one row per layer, one tab-separated score per KV head, clipped to [0, 1]);
- else a calibration run evalkit performs on the loaded model (`prepare`): `calibration_samples` synthetic needles
  (evalkit's needle task, noise haystack, `calibration_context` tokens, depths spread over the context outside the
  sink and recent windows), scoring each KV head by the attention its question queries put on the needle's tokens
  (summed over the query heads of its group, averaged over samples). This replaces the paper's optimisation of gate
  values by distillation on passkey retrieval with its premise measured directly: a retrieval head is one that
  attends to distant evidence. The scores and roles are recorded in run.json (`prepared`).

Heads then hold different counts: the layer is stored ragged (evalkit.kv.cache), as for AdaKV.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor
from transformers import DynamicCache

from evalkit.attention.observation import Attended
from evalkit.attention.sdpa import observe
from evalkit.errors import ParamError
from evalkit.policies import KVPolicy, LayerView, Probes, padded_indices


@dataclass(kw_only=True)
class DuoAttention(KVPolicy):
    """Retrieval heads keep everything; streaming heads keep `sink` + `recent`; `budget`: the retrieval share."""

    name: str = "duo_attention"
    budget: float | int = 0.5
    sink: int = 64
    recent: int = 256
    pattern: str | None = None  # a full_attention_heads.tsv; None: calibrate on synthetic needles
    calibration_samples: int = 8
    calibration_context: int = 1024
    decode: bool = True  # streaming heads slide while decoding, as in the paper
    ragged: ClassVar[bool] = True
    wrappable: ClassVar[bool] = False  # its choice is its selection, not a score a wrapper could use
    chunkable: ClassVar[bool] = False
    budget_counts_tokens: ClassVar[bool] = False  # a share of retrieval heads, which keep every token

    def __post_init__(self) -> None:
        self.head_scores: np.ndarray | None = None  # (layers, Hkv), from prepare()
        self.streaming: Tensor | None = None  # (layers, Hkv) bool
        self.prepared: dict | None = None  # what prepare() reported: it runs once per policy

    # --- roles -----------------------------------------------------------------------------------------------------

    def prepare(self, model, probes: Probes) -> dict:
        """Give every KV head its role, from the pattern file or a calibration run; returns what run.json records."""
        if self.prepared is not None:
            return self.prepared
        config = model.config.get_text_config()
        shape = (config.num_hidden_layers, config.num_key_value_heads)
        if self.pattern is not None:
            scores, source = read_pattern(self.pattern, shape), f"pattern {self.pattern}"
        else:
            setting = (self.calibration_samples, self.calibration_context, self.sink, self.recent)
            done = CALIBRATED.setdefault(model, {})  # variants of one run at other budgets share the calibration
            if setting not in done:
                done[setting] = calibrate(model, probes, *setting)
            scores = done[setting]
            source = f"calibration: {self.calibration_samples} synthetic needles of {self.calibration_context} tokens"
        self.assign(scores)
        self.prepared = {
            "source": source,
            "head_scores": np.round(scores, 6).tolist(),
            "streaming": self.streaming.int().tolist(),
            "retrieval_heads": int((~self.streaming).sum()),
            "heads": int(self.streaming.numel()),
        }
        return self.prepared

    def assign(self, scores: np.ndarray) -> None:
        """Roles from (layers, Hkv) scores: the lowest round((1 - budget) x heads) stream."""
        self.head_scores = scores
        n_stream = round(scores.size * (1.0 - float(self.budget)))
        streaming = np.zeros(scores.size, dtype=bool)
        streaming[np.argsort(scores, axis=None, kind="stable")[:n_stream]] = True
        self.streaming = torch.from_numpy(streaming.reshape(scores.shape))

    # --- the choice ------------------------------------------------------------------------------------------------

    def heads(self, view: LayerView) -> Tensor:
        """(Hkv,) True for the streaming heads of the view's layer."""
        if self.streaming is None and self.pattern is not None:  # the roles need only the file and the shape
            self.assign(read_pattern(self.pattern, (view.n_layers, view.keys.shape[1])))
        if self.streaming is None:
            raise ValueError(f"{self.name}: head roles are not set; call prepare(model, tokenizer) first")
        return self.streaming[view.layer_idx].to(view.keys.device)  # (Hkv,)

    def window(self, view: LayerView) -> Tensor:
        """(B, Hkv, T) tokens a streaming head keeps: sinks and recent ones (padding, at position -1, not)."""
        pos = view.positions
        return ((pos >= 0) & (pos < self.sink)) | (pos >= view.seen - self.recent)

    def protected(self, view: LayerView, k: int) -> Tensor:
        """What it keeps by its roles, whatever any score says: a retrieval head's every token, a streaming head's
        sinks and recent tokens (the policy contract counts them, evalkit.contract)."""
        return view.real & (self.window(view) | ~self.heads(view)[None, :, None])

    def over(self, view: LayerView, k: int) -> bool:
        extra = view.real & ~self.window(view) & self.heads(view)[None, :, None]
        return bool(extra.any())

    def select(self, view: LayerView, k: int) -> Tensor:
        """(B, Hkv, kmax) ascending indices each head keeps, padded with -1: every real token in a retrieval head,
        the sinks and recent tokens in a streaming head."""
        return padded_indices(self.protected(view, k))

    def check_params(self) -> None:
        if isinstance(self.budget, int) and not isinstance(self.budget, bool):
            raise ParamError(
                {"budget": self.budget},
                f": {self.name}'s budget is the fraction of KV heads that keep the whole "
                "cache (retrieval heads), e.g. 0.5; it has no token budget",
            )
        if self.sink < 0 or self.recent < 1:
            raise ParamError({"sink": self.sink, "recent": self.recent}, ": give sink >= 0 and recent >= 1")
        if self.pattern is not None and not Path(self.pattern).is_file():
            raise ParamError({"pattern": self.pattern}, " is not a file; give a full_attention_heads.tsv")
        if self.pattern is None and (
            self.calibration_samples < 1 or self.calibration_context <= self.sink + self.recent
        ):
            raise ParamError(
                {"calibration_samples": self.calibration_samples, "calibration_context": self.calibration_context},
                f": calibrate on at least 1 needle in a context longer than sink + recent "
                f"({self.sink + self.recent} tokens)",
            )


# model -> {(samples, context, sink, recent): head scores}, for as long as the model lives
CALIBRATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_pattern(path: str, shape: tuple[int, int]) -> np.ndarray:
    """(layers, Hkv) scores from a DuoAttention `full_attention_heads.tsv`, clipped to [0, 1] as the paper's code."""
    try:
        scores = np.atleast_2d(np.loadtxt(path, dtype=float, delimiter="\t"))
    except ValueError as err:
        raise ParamError({"pattern": path}, f": not a tab-separated table of numbers ({err})") from None
    if scores.shape != shape:
        raise ParamError(
            {"pattern": path},
            f" holds {scores.shape[0]} x {scores.shape[1]} scores; the model has "
            f"{shape[0]} layers x {shape[1]} KV heads",
        )
    return np.clip(scores, 0.0, 1.0)


@torch.inference_mode()
def calibrate(model, probes: Probes, n: int, context: int, sink: int, recent: int) -> np.ndarray:
    """(layers, Hkv) mean attention the question's queries put on the needle, per KV head (see the module doc); the
    needles are the run's (Probes: evalkit's needle task, built by the run pipeline)."""
    config = model.config.get_text_config()
    scores = np.zeros((config.num_hidden_layers, config.num_key_value_heads))
    # needles outside the sinks and the recent window, spread over the rest of the context
    lo, hi = (sink + 16) / context, 1.0 - (recent + 32) / context
    depths = [round(lo + (hi - lo) * i / max(n - 1, 1), 4) for i in range(n)]
    for probe in probes.needles(context, depths)[:n]:
        observer = NeedleAttention(probe.evidence, probe.question_tokens)
        cache = DynamicCache(config=model.config)
        ids = probe.ids.to(model.device)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **observe(observer, cache))
        for layer, per_head in observer.mass.items():
            scores[layer] += per_head / n
    return scores


class NeedleAttention:
    """Per full-attention layer and KV head: the attention the last `n_queries` queries put on the `evidence`
    positions, summed over the queries of each KV group and averaged over the queries: a recorder of its own
    (evalkit.attention.observation.Recorder)."""

    def __init__(self, evidence: list[int], n_queries: int):
        self.evidence, self.n_queries = evidence, n_queries
        self.mass: dict[int, np.ndarray] = {}

    def wants_mass(self, layer_idx: int, layer) -> bool:
        return False

    def record(self, layer_idx: int, layer, at: Attended) -> None:
        if getattr(layer, "is_sliding", False):
            return
        query, key, scaling = at.query, at.key, at.scaling
        b, hq, tq, _ = query.shape
        hkv, tk = key.shape[1], key.shape[2]
        q = query[:, :, -self.n_queries :].float() * scaling
        k = key.float().repeat_interleave(hq // hkv, dim=1)
        s = q @ k.transpose(-1, -2)  # (B, Hq, nq, Tk)
        q_pos = torch.arange(tk - self.n_queries, tk, device=q.device)
        s = s.masked_fill(torch.arange(tk, device=q.device)[None, :] > q_pos[:, None], float("-inf"))
        on_needle = s.softmax(-1)[..., self.evidence].sum(-1).mean(-1)  # (B, Hq)
        self.mass[layer_idx] = on_needle.view(b, hkv, hq // hkv).sum(-1).mean(0).cpu().numpy()
