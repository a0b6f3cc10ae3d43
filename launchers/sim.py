"""The simulated engine (shims/sim.py) as a supervisord program, for tests, benchmarks and demos."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping

from launchers.common import SHIM_HOST, none_known, shim_spec
from launchers.options import Options, setting
from launchers.spec import EngineMetrics, ProgramSpec
from proxy.capabilities import Traits
from proxy.config.model import ModelConfig
from shims.sim import SimParams

PORT_FIELD = "sim_port"
# What the backend can do (proxy/capabilities.py reads it; nothing else names the backend).
TRAITS = Traits(multi_turn=True)
LOAD_OVERRIDES = ("sim",)
DEFAULT_START_TIMEOUT_S = 30.0
METRICS = EngineMetrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
                        kv_cache="vllm:kv_cache_usage_perc")


@dataclass(frozen=True)
class SimOptions(Options):
    """The simulated engine's fields (conf/schema.json: `sim`, `sim_port`), read once."""

    PREFIX = "sim_"

    params: Mapping[str, Any] = setting(key="sim", factory=dict)   # SimParams' fields, and `python`
    port: int | None = None


def device(model: ModelConfig) -> tuple[str, str]:
    """Where a replica's memory is (placement): the simulated engine is a small CPU process."""
    return "cpu", "backend sim is a CPU process"


def check(model: ModelConfig) -> list[str]:
    return []


def argv(model: ModelConfig, host: str, port: int) -> tuple[str, ...]:
    # The interpreter running the proxy has the shim's dependencies; `sim.python` may name another.
    sim = dict(SimOptions.from_config(model).params)
    args = [sim.pop("python", None) or sys.executable, "-m", "shims.sim", "--host", host, "--port", str(port),
            "--model", model.name]
    for name in SimParams.__dataclass_fields__:
        if name in sim and sim[name] is not None:
            value = sim[name]
            args += ["--" + name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return tuple(args)


def launch(model: ModelConfig, replica: int, port: int, stopwaitsecs: int, environ: Mapping[str, str]) -> ProgramSpec:
    return shim_spec(model, replica, port, stopwaitsecs, environ, argv(model, SHIM_HOST, port),
                     DEFAULT_START_TIMEOUT_S, METRICS)


# No values its server refuses beyond the schema's rules, no settings known to work against the pool.
option_problems = warnings = none_known
