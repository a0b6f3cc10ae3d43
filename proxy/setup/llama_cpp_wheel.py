"""llama-cpp-python for the `llama_cpp` backend: built once from its sdist into the llm-pool cache.

PyPI carries only the sdist, whose build takes about 8 minutes on 2 cores. The wheel is built once
per version and machine into `<cache>/wheels/` (without native CPU tuning, so a cached wheel keeps
working if the cache outlives this CPU) and installed from there into the interpreter that runs
`llm-pool setup`, so a fresh machine pays for the build once and every later run and clone reuses it.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from proxy.setup.paths import LLAMA_CPP_PYTHON_VERSION, cache_root

# The shared library only: no tools, tests, examples or server in the wheel.
CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
              "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF")


def wheel_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return cache_root() / "wheels" / f"llama-cpp-python-{version}-{platform.machine()}"


def cached_wheel(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path | None:
    found = sorted(wheel_dir(version).glob(f"llama_cpp_python-{version}-*.whl"))
    return found[-1] if found else None


def build_wheel(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None) -> Path:
    """The cached wheel for `version`, building it first if it is missing."""
    wheel = cached_wheel(version)
    if wheel is not None:
        print(f"llama-cpp-python {version}: wheel cached at {wheel}", flush=True)
        return wheel
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-cpp-python needs cmake and a C++ compiler (apt-get install cmake g++)")
    target = wheel_dir(version)
    target.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs or os.cpu_count() or 2)}
    with tempfile.TemporaryDirectory(prefix="llama-wheel-", dir=target.parent) as tmp:
        print(f"llama-cpp-python {version}: building the wheel from its sdist (about 8 minutes on 2 cores)",
              flush=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={version}", "-w", tmp], check=True, env=env)
        staged = Path(tmp) / "staged"
        staged.mkdir()
        for built in Path(tmp).glob("llama_cpp_python-*.whl"):
            built.rename(staged / built.name)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)  # atomic: a cache hit is always a whole wheel
    wheel = cached_wheel(version)
    assert wheel is not None
    print(f"llama-cpp-python {version}: built {wheel}", flush=True)
    return wheel


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_llama_cpp_python(version: str = LLAMA_CPP_PYTHON_VERSION) -> None:
    """Make `import llama_cpp` work at `version` in this interpreter, from the cached wheel."""
    if installed_version() == version:
        print(f"llama-cpp-python {version}: installed", flush=True)
        return
    wheel = build_wheel(version)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--only-binary", "llama-cpp-python",
                    "--find-links", str(wheel.parent), f"llama-cpp-python=={version}"], check=True)
    importlib.invalidate_caches()
    print(f"llama-cpp-python {version}: installed from {wheel}", flush=True)
