"""backend=llamacpp: llama.cpp in-process (llama-cpp-python) on the model's own GGUF file, KV cache types as variants.

`variants=[llamacpp:q8_0,llamacpp:k=q8_0/v=q4_0]`: keys and values of one type, or each its own (`k=TYPE/v=TYPE`,
the other f16). The baseline is the engine with its default f16 cache. Every variant and the baseline get their own
llama.cpp context, created once with the same settings but the cache types (flash attention on for all: llama.cpp
stores quantized values only with it). Per sample each context is cleared, evaluates the prompt evalkit tokenized
(the task's template), and decodes greedily (argmax of the logits) until an end-of-generation token of the model's
vocabulary or the task's answer length: the stop rule of llama.cpp's own server. The KV bytes are the engine's: the
state llama.cpp writes for the sequence (llama_state_seq_get_size) less the headers of that format (a sliding-window
layer's cache writes the cells its window still sees).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evalkit.arch import Arch, arch_from_config
from evalkit.backends import BackendSpec, Job, Result, check_generates, check_variants_unused
from evalkit.backends.agreement import full_vocabulary
from evalkit.backends.kvbytes import CACHE_TYPES, ENGINE_STATE, FORMAT, block_bytes, ggml_type
from evalkit.embedded import file_sha256, gguf_path
from evalkit.errors import ConfigError
from evalkit.fields import check_fields
from evalkit.sources import read_source

T = r"[a-z0-9_]+"  # a cache type's name
SPEC = re.compile(
    rf"llamacpp:(?:(?P<both>{T})|(?P<kv_k>{T})/(?P<kv_v>{T})|k=(?P<k>{T})(?:/v=(?P<v>{T}))?|v=(?P<vo>{T}))"
)
BASELINE_TYPES = ("f16", "f16")
INSTALL = "backend=llamacpp needs llama-cpp-python: run make install (it builds it for this CPU)"
NOT_OBSERVED = {
    "tokens_held_per_layer": "llama.cpp reports the sequence's cells, not tokens per layer",
    "tokens_allocated_per_layer": "llama.cpp reports the sequence's cells, not tokens per layer",
    "evidence_retained_per_layer": "llama.cpp exposes no per-layer view of which tokens its cache holds",
}


@dataclass(frozen=True)
class CacheTypes:
    """A variant: llama.cpp's cache types for keys and values, named as written in `variants=[...]`."""

    name: str
    k: str
    v: str


def parse_variant(spec: str) -> CacheTypes:
    """`llamacpp:q8_0` (keys and values), `llamacpp:q8_0/q4_0` (keys, then values), or named, `llamacpp:k=q8_0/v=q4_0`,
    `llamacpp:k=q8_0`, `llamacpp:v=q4_0` (the other f16; on Hydra's command line a name with `=` is quoted inside the
    list: `'variants=[llamacpp:q8_0,"llamacpp:k=q8_0/v=q4_0"]'`)."""
    match = SPEC.fullmatch(spec)
    if not match:
        raise ConfigError(
            f"variants: {spec!r} is not a llama.cpp cache type; write llamacpp:TYPE (keys and values) or "
            f"llamacpp:K_TYPE/V_TYPE, each one of {list(CACHE_TYPES)}: 'variants=[llamacpp:q8_0,llamacpp:q8_0/q4_0]'"
        )
    k = match["both"] or match["kv_k"] or match["k"] or "f16"
    v = match["both"] or match["kv_v"] or match["v"] or match["vo"] or "f16"
    for t in (k, v):
        ggml_type(t)
    if (k, v) == BASELINE_TYPES:
        raise ConfigError(
            f"variants: {spec!r} is the baseline's own f16 cache; name a cache type to compare, e.g. q8_0"
        )
    return CacheTypes(spec, k, v)


@dataclass
class Decode:
    """One greedy answer: the tokens chosen (a final end-of-generation token included), the logits behind each, and
    the KV bytes held after the prompt and at the end."""

    chosen: list[int]
    answer: list[int]
    logits: list[np.ndarray]
    held: tuple[int, int, str]  # (KV bytes, the engine's whole sequence state, their source) after the prompt
    final: tuple[int, int, str]  # the same when decoding ended
    seconds: dict[str, float]


@dataclass(kw_only=True)
class LlamaCpp:
    """The llama.cpp backend's settings (conf/backend/llamacpp.yaml) and, once opened, its contexts."""

    name: str = "llamacpp"
    flash_attn: bool = True
    threads: int | None = None
    n_ctx: int | None = None
    n_batch: int = 512
    variants: list[CacheTypes] = field(default_factory=list, init=False)
    _contexts: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _arch: Arch | None = field(default=None, init=False, repr=False)
    _version: str = field(default="", init=False, repr=False)
    _lib: Any = field(default=None, init=False, repr=False)
    _types: dict[str, tuple[str, str]] = field(default_factory=dict, init=False, repr=False)

    def check(self, spec: BackendSpec, task: Any) -> None:
        check_fields(self, "backend")
        check_generates(self.name, task)
        check_variants_unused(spec, self.name)
        if spec.model.kind != "gguf":
            raise ConfigError(
                f"backend=llamacpp runs a model's GGUF file: model={spec.model.name} is not one evalkit ships as GGUF; "
                "use model=smollm2-135m or model=gemma3-270m"
            )
        if not spec.variants:
            raise ConfigError(
                "backend=llamacpp compares KV cache types: give them as 'variants=[llamacpp:q8_0,llamacpp:q4_0]'"
            )
        self.variants = [parse_variant(s) for s in spec.variants]
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ConfigError(f"variants: {sorted({n for n in names if names.count(n) > 1})} are listed more than once")
        quantized_v = [v.name for v in self.variants if v.v not in ("f32", "f16", "bf16")]
        if quantized_v and not self.flash_attn:
            raise ConfigError(
                f"{quantized_v[0]} quantizes the values, which llama.cpp stores only with flash attention: "
                "use backend.flash_attn=true"
            )
        for key, least in (("threads", 1), ("n_ctx", 256), ("n_batch", 1)):
            if getattr(self, key) is not None and getattr(self, key) < least:
                raise ConfigError(f"backend.{key}={getattr(self, key)!r}: give a whole number of at least {least}")

    def variant_names(self) -> list[str]:
        return [v.name for v in self.variants]

    def open(self, spec: BackendSpec, jobs: list[Job]) -> dict[str, Any]:
        if importlib.util.find_spec("llama_cpp") is None:
            raise ConfigError(INSTALL)
        # OpenMP threads that spin while waiting starve each other on a shared or oversubscribed CPU (3x slower here);
        # read once, when llama.cpp's OpenMP runtime loads with it
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        llama_cpp = self._lib = importlib.import_module("llama_cpp")  # optional and heavy: loaded when a run opens it
        self._version = f"llama-cpp-python {llama_cpp.__version__}"
        path = gguf_path(spec.model)
        self._arch = arch_from_config(read_source(spec.model).raw, spec.model.name)
        longest = max((len(j.ids) + j.max_new_tokens for j in jobs), default=1)
        n_ctx = self.n_ctx or -(-longest // 256) * 256
        if longest > n_ctx:
            raise ConfigError(f"backend.n_ctx={n_ctx} is shorter than the longest prompt plus its answer ({longest})")
        threads = self.threads or os.cpu_count() or 1
        self._types = {"baseline": BASELINE_TYPES, **{c.name: (c.k, c.v) for c in self.variants}}
        for name, (k, v) in self._types.items():
            self._contexts[name] = _context(
                llama_cpp, path, n_ctx, self.n_batch, threads, self.flash_attn, k, v, spec.seed
            )
        return {
            "engine": {
                "backend": self.name,
                "engine_version": self._version,
                "gguf": str(path),
                "n_ctx": n_ctx,
                "n_batch": self.n_batch,
                "threads": threads,
                "flash_attn": self.flash_attn,
                "system": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            },
            "model": {
                "name": spec.model.name,
                "fingerprint": file_sha256(path),
                "weights_bytes": path.stat().st_size,
                "dtype": "gguf",
                "source": f"{spec.model.package}=={spec.model.package_version} ({path.name}) in llama.cpp",
            },
        }

    def run(self, jobs: list[Job]) -> Iterator[tuple[Job, list[Result]]]:
        for job in jobs:
            base = self._decode("baseline", job)
            results = [self._result("baseline", job, base, None)]
            for name in job.variants:
                results.append(self._result(name, job, self._decode(name, job), base))
            yield job, results

    def close(self) -> None:
        for llm in self._contexts.values():
            llm.close()
        self._contexts.clear()

    def _decode(self, name: str, job: Job) -> Decode:
        """Clear the context, evaluate the prompt, then take the argmax token until end of generation or the task's
        answer length."""
        llm = self._contexts[name]
        llm.reset()  # the next eval drops every cell from position 0: an empty cache
        t0 = time.perf_counter()
        logits = _eval(self._lib, llm, job.ids)
        t1 = time.perf_counter()
        held = self._kv(llm, self._types[name])
        chosen, seen = [], []
        for step in range(job.max_new_tokens):
            seen.append(logits)
            token = int(np.argmax(logits))
            chosen.append(token)
            if self._lib.llama_vocab_is_eog(llm._model.vocab, token):
                break
            if step + 1 < job.max_new_tokens:
                logits = _eval(self._lib, llm, [token])
        t2 = time.perf_counter()
        final = self._kv(llm, self._types[name])
        stopped = bool(chosen) and self._lib.llama_vocab_is_eog(llm._model.vocab, chosen[-1])
        answer = chosen[:-1] if stopped else chosen
        seconds = {"prefill": t1 - t0, "decode": t2 - t1}
        return Decode(chosen, answer, seen, held, final, seconds)

    def _kv(self, llm, types: tuple[str, str]) -> tuple[int, int, str]:
        """(KV bytes, the engine's sequence state bytes, where the bytes come from) of what the context holds now:
        llama.cpp's own figure, or, where it reports none (0 on an error), the format's block sizes."""
        state = int(self._lib.llama_state_seq_get_size(llm.ctx, 0))
        if state == 0:
            return block_bytes(self._arch, llm.n_tokens, *types), 0, FORMAT
        return state_kv_bytes(state, state_caches(self._arch, llm.n_tokens)), state, ENGINE_STATE

    def _result(self, name: str, job: Job, dec: Decode, base: Decode | None) -> Result:
        types = self._types[name]
        llm = self._contexts[name]
        text = llm.detokenize(dec.answer, prev_tokens=job.ids).decode("utf-8", errors="ignore").strip()
        held, final = dec.held[0], dec.final[0]
        fields = {
            "backend": self.name,
            "engine_version": self._version,
            "policy": {"name": "baseline"} if base is None else {"name": "none", "budget": 1.0},
            "quant": None
            if base is None
            else {"name": name, "engine": "llama.cpp", "k": types[0], "v": types[1], "flash_attn": self.flash_attn},
            "prefill": {"mode": "oneshot"},
            "kv_bytes": held,
            "kv_bytes_deployed": held,  # llama.cpp holds the cache as the deployed engine does: these are its bytes
            "kv_bytes_final": final,
            "peak_kv_bytes": final,  # nothing is evicted: the cache only grows while the answer is decoded
            "decode_peak_kv_bytes_deployed": final,  # the cache decoded from grows to its largest at the end
            "kv_bytes_source": dec.held[2],
            "engine_state_bytes": dec.held[1],
            "prefill_peak_kv_bytes": held,
            "prefill_peak_tokens": len(job.ids),
            "prefill_bound_tokens": None,
            "tokens_held_per_layer": None,
            "tokens_allocated_per_layer": None,
            "evidence_retained_per_layer": None,
            "not_observed": NOT_OBSERVED,
            "attention_path": "llama.cpp flash attention" if self.flash_attn else "llama.cpp",
            "generated_tokens": len(dec.answer),
            "seconds": {k: round(v, 4) for k, v in dec.seconds.items()},
            "fidelity": None if base is None else full_vocabulary(base.logits, dec.logits, base.chosen, dec.chosen),
        }
        return Result(name, text, fields)


# Headers llama.cpp writes around a sequence's KV data (src/llama-kv-cache.cpp, state_write): the magic and sequence
# id (8 bytes); then for each cache (one; two for a model with sliding-window layers, the full layers' and the
# window's) its stream and cell counts (8), per cell its position, sequence count and sequence id (12), the
# V-transposed flag and layer count (8), and per layer a type and a row size for keys and again for values (2 x 12).
STATE_MAGIC, CACHE_FIXED, PER_CELL, PER_LAYER = 8, 16, 12, 24


def state_kv_bytes(state: int, caches: list[tuple[int, int]]) -> int:
    """The KV data in a llama.cpp sequence state of `state` bytes whose caches hold (cells, layers) each; a
    sliding-window cache writes only the cells its window still sees."""
    return state - STATE_MAGIC - sum(CACHE_FIXED + PER_CELL * cells + PER_LAYER * layers for cells, layers in caches)


def state_caches(arch: Arch, tokens: int) -> list[tuple[int, int]]:
    """(cells, layers) of each cache llama.cpp keeps for `tokens` tokens of a model."""
    full = arch.layers - arch.sliding_layers
    if not arch.sliding_layers:
        return [(tokens, full)]
    return [(tokens, full), (min(tokens, arch.window or tokens), arch.sliding_layers)]


def _context(
    llama_cpp, path: Path, n_ctx: int, n_batch: int, threads: int, flash_attn: bool, k: str, v: str, seed: int
):
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attn,
            type_k=int(ggml_type(k)),
            type_v=int(ggml_type(v)),
            seed=seed,
            logits_all=False,
            swa_full=False,  # sliding-window layers cache their window, as llama.cpp's CLI and server do by default
            verbose=False,
        )
    except ValueError as err:
        raise ConfigError(f"llama.cpp could not create a context with K {k} and V {v} ({err})") from None


def _eval(lib, llm, ids: list[int]) -> np.ndarray:
    """Evaluate `ids` after what the context holds; the logits of the last one (n_vocab,), copied."""
    llm.eval(ids)
    ptr = lib.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),)).copy()
