"""The kvpress half of benchmarks/peer_kvpress.py: run in a throwaway venv that has kvpress, never in evalkit's.

    /tmp/kvpress-venv/bin/python benchmarks/_kvpress_side.py --model DIR --input in.json --output out.json

Imports only kvpress, transformers and torch. `in.json` is {"prompts": [{"name": ..., "ids": [...]}, ...]}.
For every prompt, press and compression ratio it prefills the ids once under the press, then recovers which token
positions each layer and KV head still holds by matching every held key row against the keys of a plain prefill
of the same ids (post-RoPE keys differ from position to position, and a press only gathers rows, so each held
row equals exactly one full-cache row). That needs nothing from the press's internals, and also checks that
the press did nothing but select rows. Presses that rewrite what they keep: ThinK's zeroed key channels are left out
of the match (CHANNELS); KeyRerotation's re-rotated keys match no full-cache key, so the indices it re-rotates are
recorded as its rerotate_keys receives them (`recording_rerotation`) and its held values checked against the
full cache's at those positions. For every press in REWRITES the output also holds digests of the held keys and
values and each head's zeroed key channels (benchmarks/_digest.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import kvpress
import numpy as np
import torch
import transformers
from _digest import digest, pruned  # benchmarks/_digest.py, beside this script: evalkit's side digests alike
from kvpress.presses.fastkvzip_press import FastKVzipGate
from kvpress.presses.kvzap_press import KVzapModel
from kvpress.presses.qfilter_press import QFilters
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

SINKS, WINDOW, KERNEL, BETA = 4, 32, 5, 20
LAZY = {0.5: 0.8, 0.75: 0.6}  # SimLayerKV's lazy_threshold in each ratio's slot: it has no ratio of its own
LAZY_RECENT = 128  # SimLayerKV's n_recent: below both prompts' lengths (kvpress's default 1024 would keep all)
DMS_THRESHOLD = {0.5: -5.0, 0.75: -4.0}  # DMSPress's threshold on KVzap's scores in each ratio's slot: it has no ratio
# Presses whose held keys are not rows of the full cache (re-rotated, channels zeroed): their kept positions are
# recovered from the held values, which they leave as they were
CHANNELS = ("think", "think_snapkv")  # keys matched on the channels they hold, not the zeroed ones
REROTATED = ("key_rerotation_snapkv", "finch", "finch_chunk")  # positions recorded from rerotate_keys
# their held tensors are digested
REWRITES = (
    "key_rerotation_snapkv",
    "merging_snapkv",
    "think",
    "think_snapkv",
    "finch",
    "finch_chunk",
    "cam_knorm",
)
# Finch's window is the question, which it finds after a delimiter token the user inserts (its hook removes it from
# the embeddings): the prompt's last FINCH_QUESTION ids play the question, the delimiter an id the prompt lacks
FINCH_QUESTION = 40
FINCH_CHUNK = 413  # chunks of 826 ids: 2 of 413; of 1821: 4 and 169, whose share still holds the question at a quarter
ROTATED: list[torch.Tensor] = []  # per layer, in forward order: the (Hkv, k) indices KeyRerotationPress re-rotated


def recording_rerotation() -> None:
    """Record, unchanged, the indices KeyRerotationPress passes to its rerotate_keys (the positions it keeps)."""
    original = kvpress.KeyRerotationPress.rerotate_keys

    def rerotate_keys(module, indices, keys):
        ROTATED.append(indices[0].clone())
        return original(module, indices, keys)

    kvpress.KeyRerotationPress.rerotate_keys = staticmethod(rerotate_keys)


# Compressing while decoding: the first DECODE_CONTEXT ids prefilled, the next DECODE_STEPS fed one at a time at their
# positions, the press compressing every DECODE_INTERVAL of those forwards; KNorm scores (kvpress's DecodingPress
# requires a ScorerPress). DecodingPress keeps DECODE_TARGET tokens (the prefill untouched);
# CompressionRatioDecodingPress a share of every token seen, after the prefill compressed to the same share
DECODE_CONTEXT, DECODE_STEPS, DECODE_INTERVAL, DECODE_TARGET = 760, 48, 8, 764
DECODING = ("decoding_knorm", "ratio_decoding_knorm", "decoding_tova", "cam_knorm")
CAM_SEED = 0  # torch's global generator seeded so before CAMPress's decode (its Bernoulli merges draw from it)
SEEDING = [True]  # whether each layer's forward reseeds the generator (seed_each_layer): off for CaM's one stream
SKETCH_SEED = 0  # evalkit's leverage and compactor draw layer i's sketch from seed + i (their default seed: 0)


def layer_ratios(ratio: float, n_layers: int = 30, spread: float = 0.2) -> list[float]:
    """A compression ratio per layer, from ratio - spread at the first layer to ratio + spread at the last (the same
    list benchmarks/peer_kvpress.py gives evalkit's per_layer)."""
    return [ratio - spread + 2 * spread * i / (n_layers - 1) for i in range(n_layers)]


def seed_each_layer(model) -> None:
    """Seed the global generator with SKETCH_SEED + i before layer i's attention runs (a press draws from it in the
    forward hook that follows): a random sketch is then the one evalkit draws for that layer."""

    def seed(module, args) -> None:
        if SEEDING[0]:
            torch.manual_seed(SKETCH_SEED + module.layer_idx)

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(seed)


def qfilter_press(ratio: float, folder: str | None):
    """kvpress's QFilterPress with the filters of `folder` (QFilters.from_pretrained reads a local folder), instead of
    the Hub's filters it loads for the model's name when the press starts (post_init_from_model)."""
    if folder is None:
        return None
    press = kvpress.QFilterPress(compression_ratio=ratio)
    press.q_filters = QFilters.from_pretrained(folder).q_filters.to(torch.float32)
    press.post_init_from_model = lambda model: None  # the filters above, not a download
    return press


def kvzap_press(ratio: float, folder: str | None):
    """kvpress's KVzapPress with the surrogates of `folder` (KVzapModel.from_pretrained reads a local folder), instead
    of those it downloads for the model's name when the press starts."""
    if folder is None:
        return None
    press = kvpress.KVzapPress(compression_ratio=ratio, model_type="linear")
    press.kvzap_model = KVzapModel.from_pretrained(folder).to(torch.float32)
    press.post_init_from_model = lambda model: None  # the surrogates above, not a download
    return press


def fastkvzip_press(ratio: float, path: str | None):
    """kvpress's FastKVzipPress with the gates of the torch file `path` (the published format: {"module": [one state
    dict per layer]}), built as kvpress's load_fastkvzip builds them, instead of those it downloads for the model."""
    if path is None:
        return None
    gates = []
    for i, weights in enumerate(torch.load(path, weights_only=True)["module"]):
        n_kv, _, sink, dim = weights["k_base"].shape
        group = weights["q_proj.weight"].shape[0] // (n_kv * dim)
        gate = FastKVzipGate(i, weights["q_proj.weight"].shape[1], n_kv, group, torch.float32, dim, sink)
        gate.load_state_dict(weights)
        gates.append(gate)
    press = kvpress.FastKVzipPress(compression_ratio=ratio)
    press.gates = gates  # FastKVzipPress downloads only when it has none
    return press


def restorekv_press(ratio: float, folder: str | None, model):
    """kvpress's RestoreKVPress with the restore embeddings and adapter of the local folder `folder` (the published
    layout, `evalkit.calibrate restorekv`) instead of those it downloads: its embeddings set, the adapter loaded by
    PEFT under the press's adapter name, and the name it would fetch recorded as fetched."""
    if folder is None:
        return None
    press = kvpress.RestoreKVPress(compression_ratio=ratio)
    press.restore_embeddings = load_file(f"{folder}/restore_embeddings.safetensors")["restore_embeddings"].float()
    if press.adapter_name not in getattr(model, "peft_config", {}):
        model.load_adapter(folder, adapter_name=press.adapter_name)
    model.disable_adapters()
    press.restore_model_name = f"higokri/RestoreKV-{model.config.name_or_path.split('/')[-1]}"
    return press


def snapkv(ratio: float):
    """SnapKVPress with the window and kernel every SnapKV pair uses (evalkit's SnapKV is given the same)."""
    return kvpress.SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)


def lukv_press(ratio: float, curve: str | None):
    """kvpress's LUKVPress over ExpectedAttentionPress(epsilon=2e-2) (its default) with the budget curve of the file
    `curve`, instead of the one it downloads for the model's name when the press starts."""
    if curve is None:
        return None
    press = kvpress.LUKVPress(press=kvpress.ExpectedAttentionPress(epsilon=2e-2), compression_ratio=ratio)
    press._budget_curves = np.load(curve, allow_pickle=False)  # then post_init_from_model loads nothing
    return press


def presses(
    ratio: float,
    qfilters: str | None = None,
    ea_stats: str | None = None,
    lukv_curve: str | None = None,
    kvzap: str | None = None,
    fastkvzip: str | None = None,
) -> dict[str, tuple[object, str]]:
    """name -> (press, attention implementation it needs); `qfilters`, `ea_stats`, `lukv_curve`, `kvzap`, `fastkvzip`:
    the files of the Q-Filters, Expected Attention's query statistics, LU-KV's curve, KVzap's surrogates and Fast
    KVzip's gates to use (a press needing one is left out without it)."""
    return {
        # Fast KVzip with the gates of a local file (evalkit's seeded ones, evalkit.calibrate.fastkvzip); all
        # layers ranked together (its default), 4 sinks, a window of 2% of the context; kvpress masks the keys
        "fastkvzip": (fastkvzip_press(ratio, fastkvzip), "sdpa"),
        # LU-KV's per-head budgets from a local curve (evalkit's, `evalkit.calibrate lukv`); kvpress masks the keys
        "lukv_expected_attention": (lukv_press(ratio, lukv_curve), "sdpa"),
        # Expected Attention with the query statistics of a local folder (evalkit's, `evalkit.calibrate ea_stats`)
        "expected_attention_stats": (
            kvpress.ExpectedAttentionStatsPress(compression_ratio=ratio, stats_folder=ea_stats) if ea_stats else None,
            "sdpa",
        ),
        # Q-Filters from a local folder (evalkit's calibration, `evalkit.calibrate qfilter`), as evalkit reads them
        "qfilter": (qfilter_press(ratio, qfilters), "sdpa"),
        # KVzap's linear surrogates from a local folder (evalkit's stand-in fit, `python -m evalkit.calibrate kvzap`)
        "kvzap": (kvzap_press(ratio, kvzap), "sdpa"),
        # DMS over the same surrogates: no ratio, a threshold in each ratio's slot (DMS_THRESHOLD), the last 128 kept
        "dms_kvzap": (
            kvpress.DMSPress(kvzap_press(ratio, kvzap), threshold=DMS_THRESHOLD[ratio], sliding_window_size=128)
            if kvzap
            else None,
            "sdpa",
        ),
        "streaming_llm": (kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=SINKS), "sdpa"),
        "knorm": (kvpress.KnormPress(compression_ratio=ratio), "sdpa"),
        "snapkv": (snapkv(ratio), "sdpa"),
        "pyramidkv": (
            kvpress.PyramidKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL, beta=BETA),
            "sdpa",
        ),
        "observed_attention": (kvpress.ObservedAttentionPress(compression_ratio=ratio), "eager"),
        "tova": (kvpress.TOVAPress(compression_ratio=ratio), "sdpa"),
        "keydiff": (kvpress.KeyDiffPress(compression_ratio=ratio), "sdpa"),
        # kvpress's defaults: 512 future positions, 4 sinks, covariance and value norm used, epsilon 0
        "expected_attention": (kvpress.ExpectedAttentionPress(compression_ratio=ratio), "sdpa"),
        # KVzip (chunked context reconstruction, 4 sinks, chunks of 2048): all layers and heads ranked together
        # (kvpress's default), per layer (layerwise), and with KVzip+ normalisation; kvpress masks the evicted keys
        "kvzip": (kvpress.KVzipPress(compression_ratio=ratio), "sdpa"),
        "kvzip_layerwise": (kvpress.KVzipPress(compression_ratio=ratio, layerwise=True), "sdpa"),
        "kvzip_plus": (kvpress.KVzipPress(compression_ratio=ratio, kvzip_plus_normalization=True), "sdpa"),
        # KVgrad: KVzip's pass (chunks of 512, its default) weighted by the probes' gradient norms and the values'
        # output norms, all layers ranked together; kvpress masks the evicted keys
        "kvgrad": (kvpress.KVgradPress(compression_ratio=ratio), "sdpa"),
        # KVCompose, structured, at its defaults (max over the repeat's queries, mean over groups and heads, the
        # layer's mean added): it reads the context again in eager attention and gathers each layer's rows
        "kvcompose": (kvpress.KVComposePress(compression_ratio=ratio), "sdpa"),
        # its unstructured setting: every KV head its own count (kvpress masks the evicted keys)
        "kvcompose_unstructured": (kvpress.KVComposePress(compression_ratio=ratio, structured=False), "sdpa"),
        # attention-free scorers at their defaults: LagKV (4 sinks, partitions of 128), CurDKV (4 sinks, key x value
        # leverage over windows of 16, no random projection); Compactor's non-causal chunked attention (chunks of 256)
        # SnapKV under a ratio per layer (layer_ratios: linear in depth, `ratio` on average)
        "per_layer_snapkv": (
            kvpress.PerLayerCompressionPress(
                kvpress.SnapKVPress(window_size=WINDOW, kernel_size=KERNEL), compression_ratios=layer_ratios(ratio)
            ),
            "sdpa",
        ),
        # KeyDiff's block-wise processing of the prompt, blocks of 128 (BlockPress's default)
        "block_keydiff": (kvpress.BlockPress(kvpress.KeyDiffPress(compression_ratio=ratio), block_size=128), "sdpa"),
        # independent chunks of 256 tokens, each compressed by KeyDiff on its own
        "chunk_keydiff": (kvpress.ChunkPress(kvpress.KeyDiffPress(compression_ratio=ratio), chunk_length=256), "sdpa"),
        # CriticalKV's two stages over SnapKV (first stage half the budget, epsilon 1e-4: kvpress's defaults)
        "criticalkv_snapkv": (kvpress.CriticalKVPress(snapkv(ratio)), "sdpa"),
        # the same two stages within AdaKV's head budgets (alpha_safeguard 0.2); kvpress masks the evicted keys
        "criticaladakv_snapkv": (kvpress.CriticalAdaKVPress(snapkv(ratio)), "sdpa"),
        # ChunkKV gated by each chunk's score entropy, chunks of 10, spiky chunks cut to 4 (its defaults), over SnapKV
        "entropy_chunkkv_snapkv": (kvpress.EntropyGatedChunkKVPress(snapkv(ratio)), "sdpa"),
        # CAPKV at its defaults (tau 5, 512 future positions, 4 sinks, epsilon 1e-6)
        "capkv": (kvpress.CapPress(compression_ratio=ratio), "sdpa"),
        "lagkv": (kvpress.LagKVPress(compression_ratio=ratio), "sdpa"),
        "cur": (kvpress.CURPress(compression_ratio=ratio), "sdpa"),
        "non_causal_attn": (kvpress.NonCausalAttnPress(compression_ratio=ratio), "sdpa"),
        # Compactor's leverage term and the whole blend at their defaults (sketch of 48; sinks 8 and 4, chunks of 256,
        # blending = the compression ratio); their Gaussian sketch is drawn from the global generator, which
        # seed_each_layer seeds with SKETCH_SEED + layer before each layer's attention, as evalkit draws it
        "leverage": (kvpress.LeverageScorePress(compression_ratio=ratio), "sdpa"),
        "compactor": (kvpress.CompactorPress(compression_ratio=ratio), "sdpa"),
        # SimLayerKV takes no ratio: in each ratio's slot a lazy_threshold that makes some layers lazy (LAZY), n_recent
        # 128, its defaults otherwise (n_last 1, n_initial 4)
        "simlayerkv": (kvpress.SimLayerKVPress(lazy_threshold=LAZY[ratio], n_recent=LAZY_RECENT), "sdpa"),
        # presses that rewrite what the kept tokens hold, over SnapKV: kept keys re-rotated to contiguous positions;
        # evicted values merged into the most similar kept token's (threshold 0, every evicted token: its defaults);
        # ThinK's key channels, a share `ratio` of them pruned alone, half of them after SnapKV (ComposedPress)
        "key_rerotation_snapkv": (kvpress.KeyRerotationPress(snapkv(ratio)), "sdpa"),
        # Finch over the whole prompt (its defaults: normalized scores, kept keys re-rotated), its question the
        # prompt's last FINCH_QUESTION ids (main inserts the delimiter before them)
        "finch": (kvpress.FinchPress(compression_ratio=ratio), "sdpa"),
        # ... and by chunks of FINCH_CHUNK tokens, each its own top-k (both prompts' last chunks hold the question)
        "finch_chunk": (kvpress.FinchPress(compression_ratio=ratio, chunk_length=FINCH_CHUNK), "sdpa"),
        "merging_snapkv": (kvpress.MergingPress(snapkv(ratio)), "sdpa"),
        "think": (kvpress.ThinKPress(key_channel_compression_ratio=ratio, window_size=WINDOW), "sdpa"),
        "think_snapkv": (
            kvpress.ComposedPress([snapkv(ratio), kvpress.ThinKPress(key_channel_compression_ratio=0.5)]),
            "sdpa",
        ),
        # compressing while decoding (DECODING): every 8 forwards to 764 tokens; a share of every token seen
        "decoding_knorm": (
            kvpress.DecodingPress(
                kvpress.KnormPress(), compression_interval=DECODE_INTERVAL, target_size=DECODE_TARGET
            ),
            "sdpa",
        ),
        "decoding_tova": (
            kvpress.DecodingPress(kvpress.TOVAPress(), compression_interval=DECODE_INTERVAL, target_size=DECODE_TARGET),
            "sdpa",
        ),
        # CaM over KNorm: the same decode and target, evicted values merged by chance into the kept tokens after them
        "cam_knorm": (
            kvpress.CAMPress(
                base_press=kvpress.KnormPress(), compression_interval=DECODE_INTERVAL, target_size=DECODE_TARGET
            ),
            "sdpa",
        ),
        "ratio_decoding_knorm": (
            kvpress.PrefillDecodingPress(
                prefilling_press=kvpress.KnormPress(compression_ratio=ratio),
                decoding_press=kvpress.CompressionRatioDecodingPress(
                    kvpress.KnormPress(), target_compression_ratio=ratio, compression_interval=DECODE_INTERVAL
                ),
            ),
            "sdpa",
        ),
        # head-adaptive: kvpress keeps every key and masks the evicted ones (module.masked_key_indices)
        "adakv_snapkv": (kvpress.AdaKVPress(snapkv(ratio)), "sdpa"),
    }


def masked_positions(model, n_tokens: int) -> list[list[list[int]]] | None:
    """Per layer and KV head, the positions a masking press (AdaKV) left unmasked after the prefill; None when no
    layer masked anything (the press gathered rows instead)."""
    layers = model.model.layers
    if all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in layers):
        return None
    out = []
    for layer in layers:
        hkv = model.config.num_key_value_heads
        keep = torch.ones(hkv, n_tokens, dtype=torch.bool)
        masked = layer.self_attn.masked_key_indices
        if masked is not None:
            _, heads, seq = masked
            keep[heads.cpu(), seq.cpu()] = False
        out.append([torch.nonzero(k).flatten().tolist() for k in keep])
    return out


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, press=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the (Hkv, T_held, D) keys and values the cache holds after prefilling `ids` (under `press`)."""
    cache = DynamicCache(config=model.config)
    if press is None:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    else:
        with press(model):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    return [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]


@torch.inference_mode()
def decoded(model, ids: torch.Tensor, press) -> tuple[list, list[torch.Tensor]]:
    """Under `press`: the first DECODE_CONTEXT ids prefilled, the next DECODE_STEPS fed one at a time at their
    positions. Per layer the (Hkv, T_held, D) keys and values held at the end, and the (Hkv, DECODE_STEPS, D) keys each
    fed token added (recorded as the cache received them, before any compression), to match the held keys against."""
    cache = DynamicCache(config=model.config)
    added: dict[int, list[torch.Tensor]] = {}
    original = DynamicLayer.update

    def update(layer, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] == 1:
            added.setdefault(id(layer), []).append(key_states[0].clone())
        return original(layer, key_states, value_states, *args, **kwargs)

    DynamicLayer.update = update
    try:
        with press(model):
            model(input_ids=ids[:, :DECODE_CONTEXT], past_key_values=cache, use_cache=True)
            for i in range(DECODE_CONTEXT, DECODE_CONTEXT + DECODE_STEPS):
                model(
                    input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[i]])
                )
    finally:
        DynamicLayer.update = original
    held = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]
    return held, [torch.cat(added[id(layer)], dim=1) for layer in cache.layers]


def positions(held: torch.Tensor, full: torch.Tensor) -> tuple[list[list[int]], float, list[list[int]]]:
    """Per KV head, the sorted positions of the full-cache rows that the held rows equal; the largest distance of a
    held row to its match (0.0 when every row was copied bit for bit); and per head the held slots in the order of
    their positions."""
    out, worst, order = [], 0.0, []
    for h in range(full.shape[0]):
        d = torch.cdist(held[h].double(), full[h].double(), compute_mode="donot_use_mm_for_euclid_dist")
        dist, idx = d.min(dim=-1)
        worst = max(worst, float(dist.max()) if dist.numel() else 0.0)
        pos = sorted(idx.tolist())
        if len(set(pos)) != len(pos):
            raise RuntimeError("two held rows matched the same position: cannot identify the kept tokens")
        out.append(pos)
        order.append(idx.argsort().tolist())
    return out, worst, order


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.75], help="kvpress compression_ratio")
    ap.add_argument("--presses", nargs="+", help="only these presses (default: every one in presses())")
    ap.add_argument("--qfilters", help="folder of the Q-Filters for the qfilter press (QFilters format)")
    ap.add_argument(
        "--ea-stats", help="folder of Expected Attention's query statistics (ExpectedAttentionStats format)"
    )
    ap.add_argument("--lukv-curve", help="LU-KV's budget curve, a .npy file (99, layers, KV heads)")
    ap.add_argument("--kvzap", help="folder of KVzap's surrogates (KVzapModel format) for the kvzap press")
    ap.add_argument("--fastkvzip", help="Fast KVzip's gates (a torch file, the published format)")
    ap.add_argument("--restorekv", help="RestoreKV's folder (restore embeddings and a PEFT LoRA adapter)")
    args = ap.parse_args()
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    recording_rerotation()
    with open(args.input) as f:
        prompts = json.load(f)["prompts"]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    seed_each_layer(model)
    cfg = model.config
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt["ids"]])
        full = {}
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            full[impl] = prefill(model, ids)
        kept, held, worst, digests, channels = {}, {}, 0.0, {}, {}
        for ratio in args.ratios:
            files = (args.qfilters, args.ea_stats, args.lukv_curve, args.kvzap, args.fastkvzip)
            every = presses(ratio, *files)
            if args.restorekv and (not args.presses or "restorekv" in args.presses):
                # PEFT wraps the adapted layers once loaded; disabled, as kvpress leaves them, they compute as before
                every["restorekv"] = (restorekv_press(ratio, args.restorekv, model), "sdpa")
            for name, (press, impl) in every.items():
                if args.presses and name not in args.presses or press is None:
                    continue
                model.set_attn_implementation(impl)
                for layer in model.model.layers:
                    layer.self_attn.masked_key_indices = None
                ROTATED.clear()
                if name in DECODING:  # held keys matched against the context's and those the fed tokens added
                    # CaM's draws, one stream from CAM_SEED (the layers' sketch seeding off); the others draw nothing
                    torch.manual_seed(CAM_SEED)
                    SEEDING[0] = name != "cam_knorm"
                    layers, added = decoded(model, ids, press)
                    SEEDING[0] = True
                    plain = prefill(model, ids[:, :DECODE_CONTEXT])
                    pool = [(torch.cat([k, a], dim=1), v) for (k, v), a in zip(plain, added, strict=True)]
                elif name in ("finch", "finch_chunk"):  # the delimiter before the question; the cache holds none
                    press.delimiter_token_id = next(i for i in range(cfg.vocab_size - 1, 0, -1) if i not in ids[0])
                    delimited = torch.cat(
                        [
                            ids[:, :-FINCH_QUESTION],
                            torch.tensor([[press.delimiter_token_id]]),
                            ids[:, -FINCH_QUESTION:],
                        ],
                        dim=1,
                    )
                    layers, pool = prefill(model, delimited, press), full[impl]
                else:
                    layers, pool = prefill(model, ids, press), full[impl]
                key = f"{name}@{ratio}"
                kept[key], held[key] = [], []
                unmasked = masked_positions(model, ids.shape[1])
                if name == "restorekv":  # the restore tokens' keys and values, after the context's ids
                    n = ids.shape[1]
                    order = [list(range(layers[0][0].shape[1] - n))] * layers[0][0].shape[0]
                    digests[key] = [digest(k[:, n:], v[:, n:], order) for k, v in layers]
                    channels[key] = [pruned(k[:, n:]) for k, _ in layers]
                if unmasked is not None:
                    kept[key] = unmasked
                    held[key] = [sum(len(h) for h in layer) for layer in unmasked]  # all heads: heads differ
                    print(f"{prompt['name']} {key}: held per layer {held[key]}", file=sys.stderr, flush=True)
                    continue
                for layer, (h_kv, f_kv) in enumerate(zip(layers, pool, strict=True)):
                    if name in REROTATED:  # the recorded positions; the values held there are the full cache's
                        idx = ROTATED[layer]
                        pos, order = idx.sort(dim=-1).values.tolist(), idx.argsort(dim=-1).tolist()
                        there = f_kv[1].gather(1, idx[..., None].expand_as(h_kv[1]))
                        dist = float((h_kv[1] - there).norm(dim=-1).max())
                    elif name in CHANNELS:  # the held channels of each head; the zeroed ones left out of the match
                        pos, dist, order = positions(h_kv[0], f_kv[0] * (h_kv[0] != 0).any(dim=1, keepdim=True))
                    else:
                        pos, dist, order = positions(h_kv[0], f_kv[0])
                    if dist > 1e-4:
                        raise RuntimeError(f"{key} layer {layer}: a held row is {dist} from every full-cache row")
                    worst = max(worst, dist)
                    kept[key].append(pos)
                    held[key].append(len(pos[0]))
                    if name in REWRITES:
                        digests.setdefault(key, []).append(digest(*h_kv, order))
                        channels.setdefault(key, []).append(pruned(h_kv[0]))
                print(f"{prompt['name']} {key}: held per layer {held[key]}", file=sys.stderr, flush=True)
        results.append(
            {
                "name": prompt["name"],
                "n_tokens": len(prompt["ids"]),
                "kept": kept,
                "max_match_dist": worst,
                "digests": digests,
                "pruned_channels": channels,
            }
        )

    meta = {
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": {
            "n_layers": cfg.num_hidden_layers,
            "n_heads": cfg.num_attention_heads,
            "n_kv_heads": cfg.num_key_value_heads,
            "dtype": "float32",
        },
        "settings": {
            "compression_ratios": args.ratios,
            "streaming_llm": {"n_sink": SINKS, "attn_implementation": "sdpa"},
            "knorm": {"attn_implementation": "sdpa"},
            "snapkv": {"window_size": WINDOW, "kernel_size": KERNEL, "attn_implementation": "sdpa"},
            "pyramidkv": {"window_size": WINDOW, "kernel_size": KERNEL, "beta": BETA, "attn_implementation": "sdpa"},
            "observed_attention": {"attn_implementation": "eager"},
            "tova": {"attn_implementation": "sdpa"},
            "keydiff": {"attn_implementation": "sdpa"},
            "kvzip": {"layerwise": False, "n_sink": 4, "chunk_size": 2048, "attn_implementation": "sdpa"},
            "kvzip_layerwise": {"layerwise": True, "n_sink": 4, "chunk_size": 2048, "attn_implementation": "sdpa"},
            "kvzip_plus": {"kvzip_plus_normalization": True, "n_sink": 4, "chunk_size": 2048},
            "finch": {
                "question": FINCH_QUESTION,
                "normalize_scores": True,
                "rerotate_keys": True,
                "chunk_length": None,
            },
            "finch_chunk": {
                "question": FINCH_QUESTION,
                "normalize_scores": True,
                "rerotate_keys": True,
                "chunk_length": FINCH_CHUNK,
            },
            "expected_attention": {
                "n_future_positions": 512,
                "n_sink": 4,
                "use_covariance": True,
                "use_vnorm": True,
                "epsilon": 0.0,
                "attn_implementation": "sdpa",
            },
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    with open(args.output, "w") as f:
        json.dump({"meta": meta, "prompts": results}, f)


def version(dist: str) -> str:
    from importlib.metadata import version as _version

    return _version(dist)


if __name__ == "__main__":
    main()
