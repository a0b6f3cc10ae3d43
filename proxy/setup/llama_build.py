"""Build llama-server from the llama.cpp tree vendored in the llama-cpp-python sdist.

PyPI is the one place this project may fetch native sources from, and the llama-cpp-python sdist
carries a pinned llama.cpp. Only the `llama-server` target is built, statically linked and without
native CPU tuning so that a cached binary keeps running if the cache outlives this CPU. The result
is cached outside the repo, keyed by version, so later clones and CI runs reuse it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from proxy.setup.paths import LLAMA_CPP_PYTHON_VERSION, cache_root, cached_llama_server

__all__ = ["LLAMA_CPP_PYTHON_VERSION", "build_llama_server", "cache_root", "cached_llama_server"]

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    # The web UI would be downloaded at configure time; the pool never serves it.
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


def _run(argv: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, cwd=cwd, check=True)


def build_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None) -> Path:
    """Return the cached llama-server for `version`, building it first if it is missing."""
    target = cached_llama_server(version)
    if target.is_file() and os.access(target, os.X_OK):
        print(f"llama-server {version}: cached at {target}", flush=True)
        return target
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake and a C++ compiler (apt-get install cmake g++)")
    jobs = jobs or os.cpu_count() or 2
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two callers at once (a setup and a test run, or parallel CI jobs) must not both spend a
    # quarter of an hour compiling: the second waits for the first and then finds the binary.
    with open(target.with_name("build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and os.access(target, os.X_OK):
            print(f"llama-server {version}: built meanwhile by another process, at {target}", flush=True)
            return target
        return _build(version, jobs, target)


def _build(version: str, jobs: int, target: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=target.parent) as tmp:
        work = Path(tmp)
        print(f"llama-server {version}: downloading the llama-cpp-python sdist", flush=True)
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", str(work)])
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        print(f"llama-server {version}: configuring and building with {jobs} jobs "
              "(about 9 minutes on 2 cores)", flush=True)
        _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS])
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)])
        built = build / "bin" / "llama-server"
        staged = target.with_name("llama-server.partial")
        shutil.copy2(built, staged)
        staged.replace(target)  # atomic: a cache hit is always a whole binary
    print(f"llama-server {version}: built {target}", flush=True)
    return target
