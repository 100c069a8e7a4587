"""Triton kernels for quantized KV storage, each beside a plain PyTorch reference (issue 4)."""
