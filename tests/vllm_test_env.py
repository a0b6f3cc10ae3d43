"""What the tests that run a real vLLM share: which `vllm` runs (the CPU build the llm-pool cache
holds, or a CUDA build named by LLM_POOL_TEST_VLLM: tests/gpu/), its environment, the mark that
skips them where there is none, and the processes of a replica (vLLM's engine core is a child
process that must not outlive a test)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy.setup.vllm_env import cached_vllm, server_env, vllm_env_ready

CUDA_VLLM = os.environ.get("LLM_POOL_TEST_VLLM")
START_S = 900.0   # a vLLM start on a busy 2-core machine: imports, weights, profiling
NEEDS_VLLM = pytest.mark.skipif(
    not CUDA_VLLM and not vllm_env_ready(),
    reason="no vLLM: the CPU build is not in the llm-pool cache "
           "(run `llm-pool setup --all-engines`, or set LLM_POOL_TEST_VLLM to a `vllm` command)")


def vllm_command() -> str:
    return CUDA_VLLM or str(cached_vllm())


def vllm_env() -> dict[str, str]:
    env = server_env()
    if CUDA_VLLM:
        env.pop("VLLM_TARGET_DEVICE")
    return env


def process_group(pid: int) -> set[int]:
    """Every live process in the group of `pid` (supervisord starts each program as a group
    leader; vLLM's engine core runs as a child in it)."""
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pid:
                members.add(int(entry.name))
    return members
