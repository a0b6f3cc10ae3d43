"""Pieces every launcher shares: the replica's environment and file checks."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from launchers.gguf_header import MAGIC as GGUF_MAGIC
from launchers.spec import EngineMetrics, ProgramSpec, program_name
from proxy.config.files import REPO_ROOT
from proxy.config.model import ModelConfig


def library_env(model: ModelConfig, libs: Sequence[str],
                environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """CUDA_VISIBLE_DEVICES from the model's GPUs and its library path (`libs`, its backend's
    `*_library_path`) prepended to LD_LIBRARY_PATH.

    `environ` is the environment supervisord passes on (the proxy's own in managed mode); it is an
    argument so that the launcher stays a pure function of its inputs.
    """
    env: dict[str, str] = {}
    if model.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in model.gpus)
    if libs:
        inherited = environ.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = ":".join([*libs, *([inherited] if inherited else [])])
    return tuple(sorted(env.items()))


def missing_file(where: str, key: str, value: Any) -> list[str]:
    if value and not Path(value).exists():
        return [f"{where}.{key}: {value} does not exist"]
    return []


def gguf_problem(path: Path, backend: str) -> str | None:
    """Why the existing `path` is not the GGUF file `backend` loads, or None. Caught here, a folder or
    a stray file is a config error; at load it was only `failed to read magic` in a log tail."""
    if path.is_dir():
        return f"{path} is a folder; backend {backend!r} needs a GGUF file"
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror}"
    if magic != GGUF_MAGIC:
        return f"{path} is not a GGUF file (it does not start with the GGUF magic)"
    return None


def model_file_problems(where: str, key: str, value: Any, judge: Callable[[Path], str | None]) -> list[str]:
    """A path field that must exist and be what `judge` (a GGUF file, a model folder) accepts."""
    if not value:
        return []
    path = Path(value)
    if not path.exists():
        return [f"{where}.{key}: {value} does not exist"]
    problem = judge(path)
    return [f"{where}.{key}: {problem}"] if problem else []


def managed_flag_problem(where: str, given: str, flag: str, field: str | None, engine: str) -> str:
    """An extra argument `given` that sets `flag` again, which llm-pool sets from `field` (None: for
    itself): the engine keeps the last one given, so the field would be silently lost."""
    shown = given if given == flag else f"{given} ({flag})"
    if field is None:
        return f"{where}: {shown} is set by llm-pool itself, and {engine} keeps the last one given; remove it"
    return (f"{where}: {shown} is set by llm-pool from {field}, and {engine} keeps the last one given, so one "
            f"of the two would be silently lost; set {field} instead")


def shim_env(model: ModelConfig, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """library_env (a shim has no library path of its own) plus PYTHONPATH naming llm-pool's own source tree.

    A shim runs `python -m shims.<engine>`, possibly under an interpreter of its own (`<engine>_python`)
    that has its engine installed but not llm-pool; PYTHONPATH lets it import `shims` from the tree the
    proxy runs from, never from whatever copy that interpreter might happen to have.
    """
    return tuple(sorted({**dict(library_env(model, (), environ)), "PYTHONPATH": str(REPO_ROOT)}.items()))


def shim_problems(model: ModelConfig, model_path: str | None, module: str, python_field: str, python: str | None,
                  extra: str, judge: Callable[[Path], str | None]) -> list[str]:
    """What stops a shim backend from starting: no model, a model `judge` refuses (a file where the
    engine reads a folder, or the other way round), or no interpreter with its engine.

    Without `<engine>_python` the shim runs under the proxy's own interpreter, so the engine must be
    importable there; `find_spec` finds it without importing it (heavy imports stay in the shim).
    `model_path` and `python` are the model's settings of those fields (its backend's options).
    """
    where = f"engine.models.{model.name}"
    problems = []
    if not model_path:
        problems.append(f"{where}.model_path: required for backend {model.backend!r}")
    else:
        problems += model_file_problems(where, "model_path", model_path, judge)
    if python:
        if not (Path(python).is_file() and os.access(python, os.X_OK)):
            problems.append(f"{where}.{python_field}: {python} is not an executable interpreter")
    elif importlib.util.find_spec(module) is None:
        problems.append(f"{where}.backend: {model.backend!r} needs the {module} package in this interpreter "
                        f"(pip install 'llm-pool[{extra}]'), or {python_field} naming one that has it")
    return problems


def shim_argv(model: ModelConfig, model_path: str | None, python: str | None, engine: str, host: str, port: int,
              stopwaitsecs: int) -> list[str]:
    """`python -m shims.<engine>` with the arguments every shim takes.

    The shim's own drain deadline is inside supervisord's stop wait, so it exits by itself after
    finishing what it can instead of being killed mid-write.
    """
    return [python or sys.executable, "-m", f"shims.{engine}", "--host", host, "--port", str(port),
            "--model", model.name, "--shutdown-timeout", str(max(1, stopwaitsecs - 2)), "--model-path", str(model_path)]


SHIM_HOST = "127.0.0.1"


def shim_spec(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str],
              argv: tuple[str, ...], start_timeout_s: float, metrics: EngineMetrics) -> ProgramSpec:
    """The spec of a shim replica (shims/core.py): on loopback, with /health, /v1/models and /metrics."""
    return ProgramSpec(
        program=program_name(model.name, replica),
        argv=argv,
        env=shim_env(model, environ),
        host=SHIM_HOST,
        port=port,
        health_path="/health",
        models_path="/v1/models",
        served_model=model.name,
        start_timeout_s=start_timeout_s,
        stopwaitsecs=stopwaitsecs,
        metrics=metrics,
    )


def none_known(model: ModelConfig) -> list[str]:
    """A Launcher's option_problems or warnings where a backend has none of that kind to report."""
    return []
