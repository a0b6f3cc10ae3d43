"""A request that a replica did not take goes to another one, once: the data path against two real
HTTP servers on loopback standing in for replicas (one of them not serving), a fake supervisord."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from fakes import FakeSupervisor
from launchers import sim
from proxy.config.loading import load_settings
from proxy.errors import BackendError
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.serving.forward import upstream
from proxy.edge.relay import Timeouts

TIMEOUTS = Timeouts(first_byte_s=10, idle_s=10)
ANSWER = {"choices": [{"message": {"content": "hi"}}]}


def answering_with(status: int, body: dict[str, Any]) -> Any:
    async def handle(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)
    return handle


async def server(handler: Any) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[Any]:
    """A loaded model of two READY replicas: 0 answers what `handlers[0]` says, 1 always answers."""
    handlers: dict[int, Any] = {}
    seen: list[int] = []

    def answering(index: int) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            seen.append(index)
            return await handlers[index](request)
        return handle

    handlers[1] = answering_with(200, ANSWER)
    runners = [await server(answering(i)) for i in (0, 1)]
    (tmp_path / "pool.yaml").write_text(f"service: {{state_dir: {tmp_path}}}\n"
                                        "engine: {models: {m: {backend: sim, target_inflight: 1, replicas: 2}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    async with aiohttp.ClientSession() as http:
        pool = Pool(settings, FakeSupervisor(), http=http, environ={})
        runtime = pool.models["m"]
        runtime.state = ModelState.LOADED
        for i, (_, port) in enumerate(runners):
            spec = sim.launch(settings.models["m"], i, port, 5, {})
            replica = Replica(model="m", index=i, spec=spec, fullname=f"g:r{i}", pid=0, reach=ProgramReach(spec))
            runtime.replicas.append(replica)
            runtime.set_replica_state(replica, ReplicaState.STARTING)
            runtime.set_replica_state(replica, ReplicaState.READY)
        # Replica 0 is the least loaded one, so it is picked first.
        runtime.replicas[1].reported = {"running": 0.5}
        yield pool, runtime, http, handlers, seen
    for runner, _ in runners:
        await runner.cleanup()


async def send(world: Any) -> tuple[int, int]:
    pool, runtime, http, _, _ = world
    async with upstream(pool.monitor, http, runtime, "/v1/chat/completions", {"messages": []}, "req_1",
                        TIMEOUTS) as (replica, resp):
        await resp.read()
        return replica.index, resp.status


async def test_a_503_from_a_restarting_replica_goes_to_another_and_takes_it_out(world: Any) -> None:
    _, runtime, _, handlers, seen = world
    handlers[0] = answering_with(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
    assert await send(world) == (1, 200)
    assert seen == [0, 1]
    # Out of rotation until its health check passes (the monitor's probe brings it back).
    assert runtime.replicas[0].state == ReplicaState.STARTING
    assert runtime.replicas[1].state == ReplicaState.READY


async def test_the_last_ready_replica_passes_its_503_on(world: Any) -> None:
    _, runtime, _, handlers, seen = world
    handlers[0] = answering_with(503, {"error": {"message": "busy"}})
    runtime.set_replica_state(runtime.replicas[1], ReplicaState.STOPPED)
    assert await send(world) == (0, 503)
    assert runtime.replicas[0].state == ReplicaState.READY


async def test_a_request_dropped_by_a_replica_whose_process_died_goes_to_another(world: Any) -> None:
    _, runtime, _, handlers, seen = world
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()   # a PID that no longer runs: what supervisord's replica was until a kill -9

    async def drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()   # the connection ends before any answer byte
        return web.Response()
    handlers[0] = drop
    runtime.replicas[0].pid = dead.pid
    assert await send(world) == (1, 200)
    assert runtime.replicas[0].state == ReplicaState.STARTING


async def test_a_live_replica_that_drops_a_request_is_not_replayed(world: Any) -> None:
    _, runtime, _, handlers, seen = world

    async def drop(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        return web.Response()
    handlers[0] = drop
    runtime.replicas[0].pid = 1   # alive: init
    with pytest.raises(BackendError, match="dropped the request"):
        await send(world)
    assert seen == [0]
    assert runtime.replicas[0].state == ReplicaState.READY
