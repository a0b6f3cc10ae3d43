"""Where llm-pool keeps what it builds once per machine, and the llama.cpp release it builds. A leaf
(os, platform, pathlib only): besides setup, the llama_server launcher reads it to find the cached
build and its --help cache (.importlinter says so by name)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

# The llama-cpp-python release whose vendored llama.cpp `llm-pool setup` builds llama-server from.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"


def cache_root() -> Path:
    """Where llm-pool keeps what it builds once per machine (llama-server, wheels, engine
    environments, tiny models): outside the repo, so clones and CI runs share it."""
    base = os.environ.get("LLM_POOL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llm-pool")
    return Path(base)


def cached_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where `llm-pool setup` puts the llama-server build for `version` (whether or not it exists yet)."""
    return cache_root() / "llama-server" / f"{version}-{platform.machine()}" / "llama-server"
