#!/usr/bin/env bash
# The vLLM tests against vLLM's CUDA build, on a machine with a GPU: the same integration suite the
# CPU build runs in CI (tests/integration/test_serve_vllm.py, with a tiny model generated on the
# spot), plus the launcher's unit tests.
#
#   tests/gpu/vllm_cuda.sh [VLLM]
#
# VLLM is a `vllm` command of a CUDA environment. Without it, one is made once in the llm-pool cache
# with `pip install vllm==0.32.0` (the version the launcher's flags are pinned to; several GB).
# PYTHON is the interpreter that has llm-pool's test dependencies (default: .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
VLLM="${1:-}"
if [ -z "$VLLM" ]; then
  env_dir="${LLM_POOL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-pool}/vllm-cuda/0.32.0-$(uname -m)"
  if [ ! -x "$env_dir/bin/vllm" ] || [ ! -f "$env_dir/.llm-pool-complete" ]; then
    rm -rf "$env_dir"
    python3 -m venv "$env_dir"
    "$env_dir/bin/pip" install -q "vllm==0.32.0"
    touch "$env_dir/.llm-pool-complete"
  fi
  VLLM="$env_dir/bin/vllm"
fi
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
"$VLLM" --version
LLM_POOL_TEST_VLLM="$VLLM" "$PYTHON" -m pytest -q -p no:cacheprovider \
  tests/launchers/test_vllm_serve.py tests/integration/test_serve_vllm.py "${@:2}"
# Nothing of the suite may hold GPU memory once it is done.
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
