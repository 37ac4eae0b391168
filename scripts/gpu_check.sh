#!/usr/bin/env bash
# bucketserve on an NVIDIA GPU vs transformers on the same GPU: exactness (fp32), CUDA-graph replay
# of every decode step (bf16), throughput (64 prompts x 128 new tokens). Needs torch with CUDA,
# transformers and grpcio; downloads nothing. Prints one summary line (GPU_CHECK PASS|FAIL ...) last.
#   scripts/gpu_check.sh                       # the H200 run (under 8 minutes)
#   scripts/gpu_check.sh --device cpu --tiny   # the same logic on CPU, in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec timeout 470 "$PYTHON" scripts/gpu_check.py "$@"
