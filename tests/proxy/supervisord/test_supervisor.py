"""The supervisord driver against a real supervisord in managed mode."""
from __future__ import annotations

import asyncio
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator

import pytest
import yaml

from fakes import BrokenCallXmlRpc
from helpers import free_port, pid_alive
from proxy.supervisord import managed
from proxy.config.loading import load_settings
from proxy.config.settings import HostSettings, Settings
from proxy.supervisord.hosts import Host
from proxy.supervisord.supervisor import BadName, NotRunning, ProcessState, SupervisorClient, SupervisorUnavailable

PROGRAM = """[group:g]
programs=sleeper
[program:sleeper]
command=sleep 300
autostart=false
autorestart=unexpected
startsecs=0
stopasgroup=true
killasgroup=true
"""


@pytest.fixture
def settings() -> Settings:
    state = Path(tempfile.mkdtemp(prefix="lp-", dir="/tmp"))
    path = state / "pool.yaml"
    path.write_text(yaml.safe_dump({"service": {"state_dir": str(state)}}))
    return load_settings(path)


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[SupervisorClient]:
    client = SupervisorClient(settings.supervisor_url, timeout=5)
    assert await managed.ensure_supervisord(settings, client)
    pid = await client.get_pid()
    yield client
    await managed.stop_supervisord(client)
    await client.close()
    assert not pid_alive(pid)


async def test_managed_supervisord_socket_is_private(settings: Settings, client: SupervisorClient) -> None:
    assert stat.S_IMODE(os.stat(settings.socket_path).st_mode) == 0o700
    assert await client.ping()
    # A second ensure finds it answering and starts nothing.
    assert not await managed.ensure_supervisord(settings, client)


async def test_group_lifecycle_and_typed_faults(settings: Settings, client: SupervisorClient) -> None:
    (settings.supervisor.programs_dir / "g.conf").write_text(PROGRAM)
    added, _, _ = await client.reload_config()
    assert added == ["g"]
    await client.add_process_group("g")
    await client.start_process("g:sleeper")
    info = await client.process_info("g:sleeper")
    assert info.state in (ProcessState.STARTING, ProcessState.RUNNING) and info.pid > 0
    with pytest.raises(BadName):
        await client.process_info("g:nobody")
    await client.stop_process("g:sleeper")
    # Bounded by time, not by a count of calls: on a busy machine supervisord reaps the child late
    # (2,000 quick calls ran out in a loaded suite run, twice).
    deadline = time.monotonic() + 60
    while (await client.process_info("g:sleeper")).state != ProcessState.STOPPED:  # noqa: ASYNC110
        assert time.monotonic() < deadline, "g:sleeper never STOPPED"
        await asyncio.sleep(0.02)
    assert not pid_alive(info.pid)
    with pytest.raises(NotRunning):
        await client.stop_process("g:sleeper")
    await client.remove_process_group("g")
    assert await client.all_process_info() == []


async def test_dead_transport_is_rebuilt_after_supervisord_restarts(settings: Settings,
                                                                   client: SupervisorClient) -> None:
    first = await client.get_pid()
    await managed.stop_supervisord(client)
    with pytest.raises(SupervisorUnavailable):
        await client.get_pid()
    assert await managed.ensure_supervisord(settings, client)
    assert await client.get_pid() != first


async def test_unanswered_socket_is_unavailable(tmp_path: Path) -> None:
    client = SupervisorClient(f"unix://{tmp_path}/none.sock", timeout=1)
    assert not await client.ping()
    with pytest.raises(SupervisorUnavailable):
        await client.get_pid()
    await client.close()


async def test_an_unanswered_node_is_named_without_its_credentials() -> None:
    url = f"http://pool:node-SECRET-pw@127.0.0.1:{free_port()}"   # nothing listens there
    client = SupervisorClient(url, timeout=1)
    with pytest.raises(SupervisorUnavailable) as info:
        await client.get_pid()
    await client.close()
    assert "supervisord at http://127.0.0.1:" in str(info.value) and "node-SECRET-pw" not in str(info.value)
    host = Host(name="n", client=client, log_dir=None,
                settings=HostSettings(name="n", url=url, username="pool", password_env="X", address="127.0.0.1"))
    assert host.describe()["url"] == url.replace("pool:node-SECRET-pw@", "")


async def test_a_call_that_fails_does_not_break_the_calls_in_flight_beside_it() -> None:
    # Before: the failed call closed the whole session, and the held getState beside it failed
    # with ServerDisconnectedError: one slow call marked a node that answered as down.
    server = await BrokenCallXmlRpc().start()
    client = SupervisorClient(server.url, timeout=30)
    try:
        held = asyncio.create_task(client.call("supervisor.getState"))
        await server.held.wait()
        with pytest.raises(SupervisorUnavailable):
            await client.get_pid()
        server.release.set()
        assert (await held)["statename"] == "RUNNING"
        assert (await client.call("supervisor.getState"))["statename"] == "RUNNING"   # a fresh transport
    finally:
        await client.close()
        await server.stop()
