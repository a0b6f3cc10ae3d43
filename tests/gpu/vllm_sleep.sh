#!/usr/bin/env bash
# Sleep instead of stop (vllm_sleep_on_evict) against vLLM's CUDA build, on a machine with a GPU:
# tests/gpu/vllm_sleep.py evicts a tiny model into sleep, wakes it with a request, and prints the
# wake beside the cold load.
#
#   tests/gpu/vllm_sleep.sh [VLLM]
#
# VLLM is a `vllm` command of a CUDA environment; without it, the one tests/gpu/vllm_cuda.sh makes in
# the llm-pool cache. PYTHON is the interpreter with llm-pool's test dependencies (.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
VLLM="${1:-${LLM_POOL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-pool}/vllm-cuda/0.32.0-$(uname -m)/bin/vllm}"
if [ ! -x "$VLLM" ]; then
  echo "no CUDA vLLM at $VLLM: run tests/gpu/vllm_cuda.sh once (it makes one), or pass a vllm command" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
"$PYTHON" tests/gpu/vllm_sleep.py "$VLLM"
# Nothing may hold GPU memory once it is done.
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
