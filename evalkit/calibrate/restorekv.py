"""Train RestoreKV's restore tokens and LoRA adapter for a model here, offline: a stand-in for the published adapters
(self-distillation from the full cache, as the paper trains them, at a toy scale), not the paper's training run.

    python -m evalkit.calibrate restorekv --model smollm2-135m --out restorekv/smollm2 [--steps 200] [--budget 0.25]
        [--tokens 8] [--rank 4] [--length 512] [--lr 1e-3]

Each step takes one generated-prose sample of evalkit's fidelity task (task seeds 7000 on, apart from any run's
default seed 0): its context prefilled with the full cache, which answers as the teacher; evalkit's KVzip scores of
the context (the reconstruction pass); k - n context tokens kept per KV head on average, k = budget x context,
ranked over all layers and heads as the policy ranks them; the n restore tokens read over the full cache with the
adapter on (policies/restorekv.read_pass, with gradients) and appended; and the continuation teacher-forced after
them, from position T + n as the policy feeds the question. The loss is KL(teacher || student) over the
continuation's next-token distributions; Adam updates the embeddings and the adapter only. Prints the held-out
loss of KVzip alone at the same budget, and of the restore tokens at the start and the end of training.

Written in the published layout, so that evalkit (`policy=restorekv policy.weights_path=OUT`) and kvpress
(RestoreKVPress, its embeddings set and the adapter loaded by PEFT from OUT) read the same folder:
restore_embeddings.safetensors, adapter_config.json and adapter_model.safetensors (PEFT's names). `--steps 0`
writes the seeded start (`initial`): the peer check's folder. Its B matrices are drawn small, not PEFT's zeros, so
that the adapter acts and the check can see it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.cache_utils import Cache

from evalkit.attention.sdpa import observe
from evalkit.calibrate.common import load_model
from evalkit.engine.engine import prefill, reconstruction
from evalkit.kv.cache import compress
from evalkit.policies.kvzip import KVzip
from evalkit.policies.kvzip_pass import ReadOnlyLayer
from evalkit.policies.restorekv import ADAPTER, EMBEDDINGS, PREFIX, Lora, read_pass
from evalkit.tasks.fidelity import FidelityTask
from evalkit.tasks.prompt import build_prompt

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention projections of every layer
SINKS, CHUNK = 4, 2048  # KVzip's (kvpress KVzipPress defaults)
TRAIN_SEED, HELD_OUT_SEED = 7000, 9000


def initial(model: torch.nn.Module, n: int, rank: int, seed: int) -> tuple[torch.Tensor, dict[str, Lora]]:
    """The seeded start: the embeddings of n token ids drawn at random, and per adapted layer A ~ N(0, 1/in) (r, in)
    and B ~ N(0, 0.01^2) (out, r), scaling alpha / r with alpha = 2r (PEFT's alpha / r of 2)."""
    g = torch.Generator().manual_seed(seed)
    table = model.get_input_embeddings().weight.detach().float()
    ids = torch.randint(0, table.shape[0], (n,), generator=g)
    lora = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in TARGETS and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=g) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=g) * 0.01
            lora[name] = Lora(a, b, 2.0)
    return table[ids].clone(), lora


def write(out: Path, embeddings: torch.Tensor, lora: dict[str, Lora], rank: int) -> None:
    """The folder in the published layout (PEFT's adapter files beside the embeddings)."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({"restore_embeddings": embeddings.detach().contiguous()}, str(out / EMBEDDINGS))
    tensors = {}
    for name, pair in lora.items():
        tensors[f"{PREFIX}{name}.lora_A.weight"] = pair.a.detach().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = pair.b.detach().contiguous()
    save_file(tensors, str(out / ADAPTER[1]))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    (out / ADAPTER[0]).write_text(json.dumps(config, indent=2) + "\n")


def samples(tokenizer, seed: int, count: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (context ids (1, T), continuation ids (1, m)) of the fidelity task's prose at task seed `seed`."""
    task = FidelityTask(seed=seed, context_lengths=[length], continuation_tokens=64, samples_per_cell=count)
    out = []
    for sample in task.samples(tokenizer):
        prompt = build_prompt(tokenizer, sample)
        out.append((prompt.ids[:, : prompt.n_context], prompt.ids[:, prompt.n_context :]))
    return out


def loss_on(model, context, continuation, embeddings, lora, budget: float) -> torch.Tensor:
    """KL(teacher || student) over the continuation, averaged over its tokens. The student is what the policy holds:
    evalkit's KVzip at k - n tokens per KV head (ranked over all layers and heads), then the restore tokens appended
    (`EvictingLayer.append`, as the engine adds them); with no restore tokens (`embeddings` None), KVzip alone at k,
    the figure they must beat."""
    t, m, n = context.shape[1], continuation.shape[1], 0 if embeddings is None else embeddings.shape[0]
    pol = KVzip(budget=max(SINKS + 1, int(budget * t) - n), n_sink=SINKS, chunk_size=CHUNK)
    full, obs = prefill(model, context, [pol])
    reconstruction(model, full, context, None, [pol], obs)
    with torch.no_grad():
        read = Cache(layers=[ReadOnlyLayer(layer.keys, layer.values) for layer in full.layers])
        teacher = model(input_ids=continuation, position_ids=torch.arange(t, t + m)[None], cache=read).logits
        cache = compress(full, pol, obs)
    if n:
        for i, (keys, values) in read_pass(model, full, embeddings, lora).items():
            cache.layers[i].append(keys, values)
    student = model(input_ids=continuation, cache=cache, use_cache=True, **observe(None, cache)).logits
    return (
        torch.nn.functional.kl_div(
            student.float().log_softmax(-1), teacher.float().log_softmax(-1), log_target=True, reduction="batchmean"
        )
        / m
    )


def main(args: argparse.Namespace) -> None:
    loaded = load_model(args.model)
    model = loaded.model
    for p in model.parameters():
        p.requires_grad_(False)
    embeddings, lora = initial(model, args.tokens, args.rank, args.seed)
    if args.steps > 0:
        params = [embeddings.requires_grad_(True)]
        for pair in lora.values():
            params += [pair.a.requires_grad_(True), pair.b.requires_grad_(True)]
        held = samples(loaded.tokenizer, HELD_OUT_SEED, args.held_out, args.length)

        def held_out() -> float:
            with torch.no_grad():
                return sum(float(loss_on(model, c, x, embeddings, lora, args.budget)) for c, x in held) / len(held)

        with torch.no_grad():
            alone = sum(float(loss_on(model, c, x, None, {}, args.budget)) for c, x in held) / len(held)
        print(f"held-out KL per token, KVzip alone at the same budget: {alone:.4f}", flush=True)
        print(f"held-out KL per token at the start: {held_out():.4f}", flush=True)
        opt = torch.optim.Adam(params, lr=args.lr)
        for step in range(args.steps):
            (context, continuation), *_ = samples(loaded.tokenizer, TRAIN_SEED + step, 1, args.length)
            opt.zero_grad()
            loss = loss_on(model, context, continuation, embeddings, lora, args.budget)
            loss.backward()
            opt.step()
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step}: train KL per token {float(loss.detach()):.4f}", flush=True)
        print(f"held-out KL per token at the end: {held_out():.4f}", flush=True)
    write(Path(args.out), embeddings, lora, args.rank)
    print(f"wrote {args.out}")
