"""A load the pool refuses before it begins (the model is loaded with other settings, there is no
room) changes nothing: the model's state, replicas, last error and queue stay as they were. A load
that fails still tells the requests queued for it why. Against the fake supervisord driver;
tests/integration/test_admin_refusals_sim.py does it over HTTP."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fakes import FakeSupervisor
from launchers import sim
from proxy.config.loading import load_settings
from proxy.errors import Conflict, Unavailable
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState


def pool_of(tmp_path: Path, models: str, lifecycle: str = "{}") -> Pool:
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        f"engine: {{lifecycle: {lifecycle}, models: {models}}}\n")
    return Pool(load_settings(tmp_path / "pool.yaml"), FakeSupervisor(), http=None, environ={})  # type: ignore[arg-type]


def loaded(pool: Pool, name: str, replicas: int) -> None:
    """`name` LOADED with `replicas` READY replicas (no processes behind them), as a load leaves it."""
    runtime = pool.models[name]
    runtime.move(ModelState.LOADING)
    for i in range(replicas):
        spec = sim.launch(runtime.config, i, 18000 + i, 5, {})
        replica = Replica(model=name, index=i, spec=spec, fullname=f"g:r{i}", reach=ProgramReach(spec))
        runtime.replicas.append(replica)
        runtime.set_replica_state(replica, ReplicaState.STARTING)
        runtime.set_replica_state(replica, ReplicaState.READY)
    runtime.move(ModelState.LOADED)
    runtime.active = runtime.config


def kept(pool: Pool, name: str) -> tuple[Any, ...]:
    runtime = pool.models[name]
    return runtime.state, list(runtime.replicas), runtime.last_error, runtime.active, runtime.admission.describe()


async def test_a_load_with_other_settings_of_a_loaded_model_is_refused_and_it_serves_on(tmp_path: Path) -> None:
    pool = pool_of(tmp_path, "{m: {backend: sim, replicas: 2, replica_max: 2}}")
    loaded(pool, "m", 2)
    before = kept(pool, "m")
    for overrides in ({"sim": {"ttft_ms": 5}}, {"replicas": 1}):
        with pytest.raises(Conflict) as refused:
            await pool.load("m", overrides)
        assert refused.value.code == "model_already_loaded"
    assert kept(pool, "m") == before
    _, waits = pool.models["m"].admission.enqueue("k")
    assert waits is None   # a request takes a place at once, as before the refusal


async def test_a_load_refused_for_want_of_room_leaves_the_requests_queued_for_it_waiting(tmp_path: Path) -> None:
    pool = pool_of(tmp_path, "{busy: {backend: sim}, b: {backend: sim, load_on_demand: true}}",
                   lifecycle="{max_loaded_models: 1}")
    loaded(pool, "busy", 1)
    await pool.models["busy"].admission.acquire("k")   # busy: it is not evicted for an admin's load
    b = pool.models["b"]
    _, waiter = b.admission.enqueue("k")               # waits for placement to make room for b
    before = kept(pool, "b")
    with pytest.raises(Unavailable) as refused:
        await pool.load("b")
    assert refused.value.code == "insufficient_memory"
    assert kept(pool, "b") == before and b.admission.waiting == 1
    assert waiter is not None and not waiter.done()


async def test_a_load_that_fails_tells_the_requests_queued_for_the_model_why(tmp_path: Path) -> None:
    pool = pool_of(tmp_path, "{b: {backend: sim, load_on_demand: true}}")
    b = pool.models["b"]
    b.kind = None   # this version cannot run its backend: the load fails, the model is FAILED
    _, waiter = b.admission.enqueue("k")
    with pytest.raises(Conflict):
        await pool.load("b")
    assert b.state == ModelState.FAILED and waiter is not None
    assert isinstance(waiter.exception(), Conflict) and waiter.exception().code == "backend_not_supported"
    assert b.admission.describe() == {"open": False, "code": "backend_not_supported", "reason": b.last_error}


async def test_a_load_on_demand_that_finds_the_model_loaded_by_an_admin_first_leaves_it_as_it_is(
        tmp_path: Path) -> None:
    pool = pool_of(tmp_path, "{m: {backend: sim, load_on_demand: true, replica_max: 2}}")
    loaded(pool, "m", 2)
    runtime = pool.models["m"]
    runtime.active = runtime.with_replicas(2)   # an admin loaded it with 2 replicas while placement decided
    before = kept(pool, "m")
    assert await pool.load_placed("m", ()) is runtime
    assert kept(pool, "m") == before
