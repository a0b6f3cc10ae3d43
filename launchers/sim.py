"""The simulated engine (shims/sim.py) as a supervisord program, for tests, benchmarks and demos."""
from __future__ import annotations

import sys
from typing import Mapping

from launchers.common import shim_env
from launchers.spec import EngineMetrics, ProgramSpec, program_name
from proxy.config import ModelConfig
from shims.sim import SimParams

PORT_FIELD = "sim_port"
LOAD_OVERRIDES = ("sim",)
DEFAULT_START_TIMEOUT_S = 30.0
METRICS = EngineMetrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
                        kv_cache="vllm:kv_cache_usage_perc")


def check(model: ModelConfig) -> list[str]:
    return []


def argv(model: ModelConfig, host: str, port: int) -> tuple[str, ...]:
    # The interpreter running the proxy has the shim's dependencies; `sim.python` may name another.
    sim = dict(model.get("sim", {}))
    args = [sim.pop("python", None) or sys.executable, "-m", "shims.sim", "--host", host, "--port", str(port),
            "--model", model.name]
    for name in SimParams.__dataclass_fields__:
        if name in sim and sim[name] is not None:
            value = sim[name]
            args += ["--" + name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    host = "127.0.0.1"
    return ProgramSpec(
        program=program_name(model.name, replica),
        argv=argv(model, host, port),
        env=shim_env(model, None, environ),
        host=host,
        port=port,
        health_path="/health",
        models_path="/v1/models",
        served_model=model.name,
        start_timeout_s=DEFAULT_START_TIMEOUT_S,
        stopwaitsecs=stopwaitsecs,
        metrics=METRICS,
    )
