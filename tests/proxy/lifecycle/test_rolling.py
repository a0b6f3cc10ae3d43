"""A roll replaces out-of-date replicas one at a time: each new one READY before an old one stops,
never zero READY, no old one stopped while the previous proxy may still use it, a restart event per
replica naming what changed; a new replica that fails stops it and the old ones serve on. Against
a fake kind (tests/fakes.py); tests/integration/test_reload_state_sim.py rolls real replicas."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fakes import FakeReplicaKind
from helpers import ready_runtime
from proxy.config.model import ModelConfig
from proxy.events import RESTART, Events
from proxy.lifecycle.state.replicas import ModelState, ReplicaState
from proxy.lifecycle.rolling import roll


class Ready:
    """The monitor's part: added replicas are judged already (the fake kind makes them READY or FAILED)."""

    async def await_replicas(self, runtime: Any, replicas: Any = None) -> None:
        return None


def world(count: int) -> tuple[Any, FakeReplicaKind]:
    config = ModelConfig(name="m", backend="sim", enabled=True, replicas=count, replica_max=count,
                         target_inflight=2, modalities=("text",), gpus=(), options={"sim": {"ttft_ms": 2}})
    runtime = ready_runtime(config, count)
    runtime.active, runtime.state = config, ModelState.LOADED
    kind = runtime.kind = FakeReplicaKind()
    for replica in runtime.replicas:
        replica.outdated = "settings changed: sim.ttft_ms"
    return runtime, kind


async def test_each_new_replica_is_ready_before_an_old_one_stops_and_ready_never_drops_below_the_count() -> None:
    runtime, kind = world(2)
    events, gone = Events(), asyncio.Event()
    gone.set()
    assert await roll(runtime, Ready(), events, gone, drain_timeout_s=1)
    # r2 (the index past the others) replaces r0, then r0 (free again) replaces r1.
    assert [(what, i) for what, i, _ in kind.calls] == [("add", 2), ("remove", 0), ("add", 0), ("remove", 1)]
    # Before each remove the old one is out of rotation already (STOPPING) and the new one READY: 2 READY.
    assert [ready for what, _, ready in kind.calls if what == "remove"] == [2, 2]
    assert sorted(r.index for r in runtime.replicas) == [0, 2] and all(r.outdated is None for r in runtime.replicas)
    restarts = events.since(kinds=frozenset({RESTART}))
    assert [(e.replica, e.reason) for e in restarts] == [(2, "settings changed: sim.ttft_ms"),
                                                         (0, "settings changed: sim.ttft_ms")]


async def test_no_old_replica_stops_before_the_previous_proxy_is_gone() -> None:
    runtime, kind = world(1)
    gone = asyncio.Event()
    rolling = asyncio.create_task(roll(runtime, Ready(), Events(), gone, drain_timeout_s=1))
    await asyncio.sleep(0.1)
    assert not rolling.done() and [c[0] for c in kind.calls] == ["add"]   # the new one runs, the old one too
    assert [r.state for r in runtime.replicas] == [ReplicaState.READY, ReplicaState.READY]
    gone.set()
    assert await asyncio.wait_for(rolling, 5)
    assert [c[:2] for c in kind.calls] == [("add", 1), ("remove", 0)]


async def test_a_new_replica_that_fails_stops_the_roll_and_the_old_ones_serve_on() -> None:
    runtime, kind = world(2)
    kind.fail_adds = 1
    events, gone = Events(), asyncio.Event()
    gone.set()
    assert not await roll(runtime, Ready(), events, gone, drain_timeout_s=1)
    assert [r.index for r in runtime.replicas] == [0, 1] and all(r.outdated for r in runtime.replicas)
    assert all(r.state == ReplicaState.READY for r in runtime.replicas)
    assert runtime.last_error is not None and "did not become ready" in runtime.last_error
    (event,) = events.since()
    assert event.kind == RESTART and "2 out-of-date replica(s) keep serving" in event.message


@pytest.mark.parametrize("state", [ModelState.UNLOADED, ModelState.FAILED])
async def test_a_model_no_longer_loaded_is_not_rolled(state: ModelState) -> None:
    runtime, kind = world(1)
    runtime.state = state
    gone = asyncio.Event()
    gone.set()
    assert not await roll(runtime, Ready(), Events(), gone, drain_timeout_s=1)
    assert kind.calls == []
