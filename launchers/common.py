"""Pieces every launcher shares: the replica's environment and file checks."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from proxy.config import REPO_ROOT, ModelConfig


def library_env(model: ModelConfig, library_field: str | None,
                environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """CUDA_VISIBLE_DEVICES from the model's GPUs and its library path prepended to LD_LIBRARY_PATH.

    `environ` is the environment supervisord passes on (the proxy's own in managed mode); it is an
    argument so that the launcher stays a pure function of its inputs.
    """
    env: dict[str, str] = {}
    if model.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in model.gpus)
    libs = list(model.get(library_field, [])) if library_field else []
    if libs:
        inherited = environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = ":".join(libs + ([inherited] if inherited else []))
    return tuple(sorted(env.items()))


def missing_file(where: str, key: str, value: Any) -> list[str]:
    if value and not Path(value).exists():
        return [f"{where}.{key}: {value} does not exist"]
    return []


def shim_env(model: ModelConfig, library_field: str | None,
             environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """library_env plus PYTHONPATH naming llm-pool's own source tree.

    A shim runs `python -m shims.<engine>`, possibly under an interpreter of its own (`<engine>_python`)
    that has its engine installed but not llm-pool; PYTHONPATH lets it import `shims` from the tree the
    proxy runs from, never from whatever copy that interpreter might happen to have.
    """
    return tuple(sorted({**dict(library_env(model, library_field, environ)), "PYTHONPATH": str(REPO_ROOT)}.items()))
