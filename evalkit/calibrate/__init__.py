"""The calibration and training tools of the learned methods, shipped in the package (`python -m evalkit.calibrate
TOOL ...`, evalkit.calibrate.main): each writes the weights file or folder a policy's `weights_path` reads, in the
published layout that kvpress reads too.

    qfilter     Q-Filters from the model's own queries (policy=qfilter)
    kvzap       KVzap's linear surrogates, a stand-in fit (policy=kvzap)
    fastkvzip   Fast KVzip's gates, a stand-in training (policy=fastkvzip)
    lukv        LU-KV's budget curve, a stand-in calibration (policy=lukv)
    ea_stats    Expected Attention's query statistics (policy=expected_attention_stats)
    restorekv   RestoreKV's restore tokens and LoRA adapter, a toy-scale self-distillation (policy=restorekv)

A command package on top, beside evalkit/cli/ (whose model_spec it reads conf/model with); nothing imports it.
"""
