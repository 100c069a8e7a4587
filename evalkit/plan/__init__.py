"""KV planning before validation: is KV memory the bottleneck, how many sequences each option buys, is offload viable.

    python -m evalkit.plan model=smollm2-135m [plan.gpu_gib=80] [plan.batch=32] [plan.context=8192]
    python -m evalkit.plan model=hf model.name_or_path=PATH/config.json plan.runs=[results/RUN1,results/RUN2]

Reads the model's config only, never its weights (a local folder or config.json, a cached Hub id, the embedded
models' converted folder or GGUF header, a tiny model's YAML), so it plans a 70B model on a laptop. Writes plan.json,
plan.md, plan.html (the tables and an interactive pressure plot, evalkit.plan.page) and plan_pressure.png into plan.out;
logger=wandb logs them. Exit codes as every evalkit command
(evalkit.errors): 0 done, 2 bad input (one line), 3 a bug.

The arithmetic, and where it comes from:
- KV bytes per token = 2 (keys and values) x layers x KV heads x head_dim x bytes per element (Pope et al. 2022,
  *Efficiently Scaling Transformer Inference*, arXiv:2211.05102); GQA and MQA through num_key_value_heads (Ainslie
  et al. 2023, arXiv:2305.13245; Shazeer 2019, arXiv:1911.02150).
- A sliding-window layer holds at most its window (Mistral 7B, Jiang et al. 2023, arXiv:2310.06825; Gemma 3's
  interleaved local/global layers, Gemma Team 2025, arXiv:2503.19786).
- MLA caches, per layer and token, the compressed latent (kv_lora_rank) and the decoupled RoPE key
  (qk_rope_head_dim), shared by all heads (DeepSeek-V2, arXiv:2405.04434, section 2.1.3).
- A decode step reads every weight once and every sequence's KV once: KV-bound when the KV bytes of the batch exceed
  the weight bytes (the memory-bound decode of Pope et al.). Paged KV allocates what a sequence holds, not its
  maximum context (PagedAttention, Kwon et al. 2023, arXiv:2309.06180); prefix caching holds a shared prefix once
  (RadixAttention, Zheng et al. 2024, arXiv:2312.07104).
The gate's capacity line (evalkit.gate) uses `capacity` here: the arithmetic exists once.
"""
