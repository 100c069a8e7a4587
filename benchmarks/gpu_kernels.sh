#!/usr/bin/env bash
# One command on a CUDA machine: time the quantized-KV Triton kernels and report bandwidth against the peak.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_kernels.py "$@"
