"""KVzip: keep the tokens the model attends to most while it reconstructs the context from the cache.

Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv:2505.23416). After
the context is prefilled, a second pass feeds, over the full cache, a repeat prompt ("Repeat the previous context
exactly.", closed by the chat template's end of the user turn and start of the answer) followed by the context itself:
the model is made to reconstruct the context, and the cached tokens it needs to do so are those it attends to. The
score of each cached key, per KV head, is the highest attention it receives from any query of that pass and any query
head of the KV group. The choice does not depend on a question, so one compressed cache serves every question.

As in the reference code (NVIDIA kvpress `KVzipPress`, after snu-mllab/KVzip): the context is reconstructed in chunks
of `chunk_size` tokens (2048), each pass over its own copy of the full cache; later chunks are prompted with "Repeat the
part of the previous context exactly, starting with" and the previous chunk's last 8 tokens. Each pass's softmax runs
over the first `n_sink` cached keys, the chunk's cached keys and the pass's own keys. The chat template's opening
(system turn, user header) is not reconstructed and scores 0, except the first `n_sink` (4) tokens, which are always
kept. The pass is the engine's (`evalkit.engine.reconstruct`); its time is recorded as `seconds.reconstruct`.

Deviations: each layer and KV head keeps exactly the budget (kvpress's default `layerwise=False` ranks all layers and
heads together, so their counts differ; the paper's non-uniform head budgets are not implemented); KVzip+'s
normalisation (`kvzip_plus_normalization`) is not implemented. Compress once, after the prompt: no chunked prefill,
no eviction while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from evalkit.errors import ConfigError
from evalkit.kv.attention import reconstruction_key
from evalkit.policies import LayerView, Need, SinkPolicy


@dataclass(kw_only=True)
class KVzip(SinkPolicy):
    """Top-k per KV head by the most attention each token gets while the context is reconstructed; sinks kept."""

    name: str = "kvzip"
    chunk_size: int = 2048  # context tokens reconstructed per pass
    decode: bool = False  # as published: compress the prompt once
    needs: ClassVar[frozenset[Need]] = frozenset({Need.RECONSTRUCTION})
    chunkable: ClassVar[bool] = False  # its scores need the whole context, reconstructed
    decodable: ClassVar[bool] = False  # no scores for the tokens added after the prompt

    def reconstruction(self) -> tuple[int, int]:
        """(sinks, chunk) of the reconstruction pass it scores with (evalkit.engine.reconstruct)."""
        return self.n_sink, self.chunk_size

    def score(self, view: LayerView) -> Tensor:
        key = reconstruction_key(*self.reconstruction())
        if key not in view.observations:
            raise ValueError(
                f"{self.name}: layer {view.layer_idx} has no reconstruction scores; the engine's run_sample runs "
                "the reconstruction pass (evalkit.engine.reconstruction) before compressing"
            )
        scores = view.observations[key]  # (B, Hkv, tokens prefilled)
        return scores.gather(-1, view.positions)

    def check_params(self) -> None:
        super().check_params()
        if self.chunk_size < 1:
            raise ConfigError(f"policy.chunk_size={self.chunk_size}: a pass reconstructs at least 1 token; e.g. 2048")
