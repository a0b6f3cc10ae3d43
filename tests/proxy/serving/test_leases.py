"""The controller's end of the workers' channel (proxy/serving/leases.py) over a real Unix socket:
a worker's report of its send becomes what forward.upstream reads in one process, and a worker that
goes away fails what it held."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.errors import PoolError
from proxy.lease_wire import frame, read_frame
from proxy.serving.leases import LeaseDesk, LeasedAnswer, Refused, WorkerGone, private_dir
from proxy.upstream.connection import MalformedAnswer


class FakeWorker:
    """A worker's end of the channel, driven by the test (the real one: proxy/worker/line.py)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def tell(self, message: dict[str, Any], payload: bytes = b"") -> None:
        self.writer.write(frame(message, payload))

    async def heard(self) -> tuple[dict[str, Any], bytes]:
        return await asyncio.wait_for(read_frame(self.reader), 5)


@pytest.fixture
async def desk(tmp_path: Path) -> Any:
    desk = LeaseDesk()
    path = tmp_path / "c.sock"
    server = await desk.serve(path)
    reader, writer = await asyncio.open_unix_connection(str(path))
    worker = FakeWorker(reader, writer)
    worker.tell({"t": "hello", "worker": 0, "pid": os.getpid()})
    await asyncio.wait_for(desk.connected.wait(), 5)
    yield desk, worker
    writer.close()
    server.close()


async def post(desk: LeaseDesk) -> "asyncio.Task[LeasedAnswer]":
    lessee = desk.lessee("0:1")
    assert lessee is not None
    http = lessee.http("req_1", False, 1000, 5.0, 5.0)
    http.at(0, "m", "replica 0 of 'm'")
    return asyncio.ensure_future(http.post("http://127.0.0.1:9/v1/chat/completions", data=b'{"a": 1}',
                                           headers={"X-Request-Id": "req_1"},
                                           timeout=aiohttp.ClientTimeout(sock_connect=5)))


async def answered(desk: LeaseDesk, worker: FakeWorker, stream: bool) -> tuple[int, LeasedAnswer]:
    """A send leased and its head told by the worker: the lease's id and the controller's answer."""
    sent = await post(desk)
    lease, _ = await worker.heard()
    worker.tell({"t": "head", "lease": lease["lease"], "status": 200, "headers": [], "stream": stream})
    return lease["lease"], await sent


async def test_a_lease_carries_the_send_and_the_head_and_end_come_back(desk: Any) -> None:
    desk, worker = desk
    sent = await post(desk)
    lease, body = await worker.heard()
    assert lease["t"] == "lease" and lease["req"] == 1 and lease["replica"] == 0 and body == b'{"a": 1}'
    worker.tell({"t": "head", "lease": lease["lease"], "status": 200,
                 "headers": [["Content-Type", "text/event-stream"]], "stream": True})
    answer = await sent
    assert answer.status == 200 and answer.streaming and answer.headers["content-type"] == "text/event-stream"
    worker.tell({"t": "end", "lease": lease["lease"], "events": 3, "ended": True, "head": 2}, b"hdtail")
    report, edges = await answer.ended()
    assert report["events"] == 3 and edges == b"hdtail"
    assert desk.lines[0].leases == {}


@pytest.mark.parametrize("kind, raised", [("refused", Refused), ("malformed", MalformedAnswer),
                                          ("reset", aiohttp.ClientOSError), ("pool", PoolError)])
async def test_a_failed_send_is_raised_as_one_process_would_meet_it(desk: Any, kind: str, raised: type) -> None:
    desk, worker = desk
    sent = await post(desk)
    lease, _ = await worker.heard()
    worker.tell({"t": "failed", "lease": lease["lease"], "kind": kind, "detail": "what it met", "status": 502,
                 "code": "backend_error"})
    with pytest.raises(raised):
        await sent
    if kind == "refused":
        assert isinstance(sent.exception(), aiohttp.ClientConnectorError) and str(sent.exception()) == "what it met"


async def test_a_whole_answer_is_read_from_its_body_frame(desk: Any) -> None:
    desk, worker = desk
    lease_id, answer = await answered(desk, worker, stream=False)
    worker.tell({"t": "body", "lease": lease_id}, b'{"ok": true}')
    assert await answer.content.readany() == b'{"ok": true}' and await answer.content.readany() == b""


async def test_a_cancelled_send_is_aborted_at_the_worker(desk: Any) -> None:
    desk, worker = desk
    sent = await post(desk)
    lease, _ = await worker.heard()
    sent.cancel()
    assert (await worker.heard())[0] == {"t": "abort", "lease": lease["lease"]}


async def test_a_worker_that_goes_away_fails_every_lease_it_held(desk: Any) -> None:
    desk, worker = desk
    _, answer = await answered(desk, worker, stream=True)
    worker.writer.close()
    with pytest.raises(WorkerGone):
        await asyncio.wait_for(answer.ended(), 5)
    assert desk.lessee("0:2") is None   # its requests can no longer be leased


async def test_a_channel_that_does_not_begin_with_hello_is_closed(tmp_path: Path) -> None:
    desk = LeaseDesk()
    server = await desk.serve(tmp_path / "c.sock")
    reader, writer = await asyncio.open_unix_connection(str(tmp_path / "c.sock"))
    writer.write(frame({"t": "end", "lease": 1}))
    assert await asyncio.wait_for(reader.read(), 5) == b""   # closed by the controller
    assert desk.lines == {}
    server.close()


def test_a_lease_header_that_names_no_connected_worker_is_none() -> None:
    desk = LeaseDesk()
    for value in ("0:1", "x:1", "0:", "", "-1:2", "0:1:2", "²:1", "0:²"):
        assert desk.lessee(value) is None


def _socket_file(path: Path) -> None:
    """A Unix socket's file, left behind as a killed process leaves it (closed, never unlinked)."""
    import socket
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))


def test_the_socket_folders_of_killed_controllers_are_removed_and_no_other(tmp_path: Path) -> None:
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()   # a PID no process has now
    orphan = tmp_path / f"llm-pool-{gone.pid}-abc"
    orphan.mkdir()
    _socket_file(orphan / "http.sock")
    _socket_file(orphan / "channel.sock")
    live = tmp_path / f"llm-pool-{os.getpid()}-def"          # a controller that runs
    live.mkdir()
    _socket_file(live / "http.sock")
    not_ours = tmp_path / f"llm-pool-{gone.pid}-ghi"         # holds what no controller writes
    not_ours.mkdir()
    (not_ours / "notes.txt").write_text("keep")
    other = tmp_path / "llm-pool-cache"                      # a name private_dir never makes
    other.mkdir()
    made = private_dir(str(tmp_path))
    assert made.name.startswith(f"llm-pool-{os.getpid()}-") and made.stat().st_mode & 0o777 == 0o700
    assert not orphan.exists()
    assert live.exists() and not_ours.exists() and other.exists()
