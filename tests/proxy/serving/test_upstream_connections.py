"""The proxy's connections to a replica (issue 16, item 2): a stream's connection is not reused,
and a request that a reused connection dropped before any answer is sent once more, on a new one.

Real HTTP on loopback: a client, the proxy's own public routes with the session the app uses
(`upstream_session`), and a fake llama-server (tests/fakes.py) that closes connections the way the
pinned one does, at the worst moment every time. The pool's supervisord is the fake driver; no
monitor runs, so only the requests under test reach the fake."""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from fakes import FakeLlamaServerHTTP, FakeSupervisor
from in_process import in_rotation, serve_routes
from launchers import llama_server
from proxy.config.loading import load_settings
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.upstream.client import UpstreamHttp
from proxy.serving.forward import upstream_session

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Proxy:
    """The proxy's routes on a loopback port, in front of READY replicas, each a fake llama-server
    (`replica` and `fake` are the first)."""

    def __init__(self, url: str, client: aiohttp.ClientSession, replicas: list[Replica],
                 fakes: list[FakeLlamaServerHTTP]) -> None:
        self.url = url
        self.client = client
        self.replicas, self.fakes = replicas, fakes
        self.replica, self.fake = replicas[0], fakes[0]
        self.http: UpstreamHttp | None = None

    async def chat(self, stream: bool = False) -> tuple[int, bytes]:
        async with self.client.post(self.url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
            return resp.status, await resp.read()


@pytest.fixture
async def proxy(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    async with contextlib.AsyncExitStack() as stack:
        async def start(replicas: int = 1, **fake_options: Any) -> Proxy:
            fakes = [await stack.enter_async_context(FakeLlamaServerHTTP(**fake_options)) for _ in range(replicas)]
            (tmp_path / "pool.yaml").write_text(
                f"service: {{state_dir: {tmp_path}}}\n"
                f"engine: {{models: {{m: {{backend: llama_server, model_path: {tmp_path / 'm.gguf'}, "
                "llama_server_binary: /bin/true, target_inflight: 2}}}\n")
            settings = load_settings(tmp_path / "pool.yaml")
            http = await stack.enter_async_context(upstream_session())
            pool = Pool(settings, FakeSupervisor(), http, environ={})  # type: ignore[arg-type]
            specs = [llama_server.launch(settings.models["m"], i, fake.port, 5, {}) for i, fake in enumerate(fakes)]
            # Alive processes (this one's PID): a replica whose process is gone is another rule's case.
            in_rotation(pool, "m", [Replica(model="m", index=i, spec=spec, fullname=f"m:r{i}", pid=os.getpid(),
                                            reach=ProgramReach(spec)) for i, spec in enumerate(specs)])
            url = await serve_routes(stack, settings, pool, http)
            client = await stack.enter_async_context(aiohttp.ClientSession())
            out = Proxy(url, client, pool.models["m"].replicas, fakes)
            out.http = http   # the app's upstream client, whose session the monitor's probes use
            return out
        yield start


def answered(status: int, body: bytes, stream: bool) -> bool:
    if stream:
        return status == 200 and body.rstrip().endswith(b"data: [DONE]") and b"error" not in body
    return status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "fake answer"


@pytest.mark.parametrize("dies", ["fin", "reset"])
async def test_the_request_after_a_stream_succeeds_on_a_new_connection(proxy, dies: str) -> None:
    p = await proxy(dies=dies)
    for stream in (True, True, False, True, False):
        status, body = await p.chat(stream)
        assert answered(status, body, stream), (status, body)
    # Each stream asked its replica to close (as llama-server does anyway), so its connection was
    # never handed to the next request: every request reached the fake once, none was resent.
    assert len(p.fake.requests) == 5
    assert all(headers.get("connection") == "close" for _, _, sent, headers in p.fake.requests if sent["stream"])
    assert p.replica.state == ReplicaState.READY and p.replica.failures == 0


async def test_non_streamed_answers_keep_their_connection(proxy) -> None:
    p = await proxy()
    for _ in range(3):
        status, body = await p.chat()
        assert answered(status, body, False)
    assert p.fake.connections == 1
    assert all(headers.get("connection") != "close" for *_, headers in p.fake.requests)


@pytest.mark.parametrize("dies", ["fin", "reset"])
async def test_a_request_a_reused_connection_dropped_is_sent_again_on_a_new_one(proxy, dies: str) -> None:
    # The kept-alive connection is closed as the proxy reuses it (a keep-alive timeout running out).
    p = await proxy(dies=dies, idle_close=True)
    for _ in range(4):
        status, body = await p.chat()
        assert answered(status, body, False), (status, body)
    # Requests 2 and 4 were read on a kept-alive connection, dropped, and answered on a new one
    # (which is then closed: it came from a connector that never pools); request 3 found the
    # pool empty and opened connection 3.
    assert [c for c, *_ in p.fake.requests] == [1, 1, 2, 3, 3, 4]
    assert p.replica.state == ReplicaState.READY and p.replica.failures == 0   # it never failed anything


async def test_a_request_dropped_on_a_new_connection_is_not_sent_again(proxy) -> None:
    # A server that dies with the request it was sent: replaying it could take the next one down.
    p = await proxy(drop_fresh=1)
    status, body = await p.chat()
    assert status == 502
    assert json.loads(body)["error"]["message"] == "replica 0 of 'm' dropped the request: ServerDisconnectedError"
    assert len(p.fake.requests) == 1
    assert p.replica.failures == 1 and p.replica.state == ReplicaState.READY   # counted, not ejected


async def test_a_resent_request_that_fails_again_is_a_502_and_not_sent_a_third_time(proxy) -> None:
    p = await proxy(idle_close=True)
    assert answered(*await p.chat(), False)
    p.fake.drop_fresh = 1   # the next new connection dies with its request
    status, body = await p.chat()
    assert status == 502 and "dropped the request" in json.loads(body)["error"]["message"]
    assert [c for c, *_ in p.fake.requests] == [1, 1, 2]
    assert p.replica.failures == 1


async def test_a_request_refused_on_its_new_connection_goes_to_no_other_replica(proxy) -> None:
    # Replica 0 drops the request on the kept-alive connection and refuses the new one: it may
    # have died of this very request, which must not take the next replica down with it.
    p = await proxy(replicas=2, idle_close=True)
    p.replicas[1].inflight = 1   # so that replica 0, the least loaded, is picked while it is READY
    assert answered(*await p.chat(), False)
    p.fake.stop_listening()
    status, body = await p.chat()
    assert status == 502, body
    assert json.loads(body)["error"]["message"] == "replica 0 of 'm' dropped the request: ClientConnectorError"
    assert len(p.fake.requests) == 2 and p.fakes[1].requests == []
    assert p.replica.state == ReplicaState.STARTING   # refused: out of rotation until healthy again


async def test_a_responses_stream_is_followed_by_a_working_request(proxy) -> None:
    p = await proxy(dies="reset")
    body = {"model": "m", "input": "hi", "stream": True}
    for _ in range(2):
        async with p.client.post(p.url + "/v1/responses", json=body) as resp:
            text = await resp.text()
        assert resp.status == 200 and "response.completed" in text, text
    status, answer = await p.chat()
    assert answered(status, answer, False)
    assert len(p.fake.requests) == 3 and p.replica.failures == 0


class KeepingUpstream:
    """A server that keeps its connections after streams as uvicorn and aiohttp do (vLLM, the
    shims): a real aiohttp app on loopback port 0 that notes, per request, the client's port (one
    per connection) and the Connection header it was sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, str | None]] = []

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.requests.append((peer[1] if peer else 0, request.headers.get("Connection")))
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": "fake answer"}}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def test_streams_to_a_server_that_keeps_connections_keep_their_connection(proxy) -> None:
    p = await proxy()
    upstream = KeepingUpstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", upstream.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        assert p.replica.spec is not None and p.replica.spec.closes_after_streams   # llama-server's
        spec = replace(p.replica.spec, port=runner.addresses[0][1], closes_after_streams=False)
        p.replica.spec, p.replica.reach = spec, ProgramReach(spec)
        for stream in (True, True, False, True):
            status, body = await p.chat(stream)
            assert answered(status, body, stream), (status, body)
    finally:
        await runner.cleanup()
    # No Connection: close asked, so every request, streams included, went on one connection.
    assert len(upstream.requests) == 4
    assert {port for port, _ in upstream.requests} == {upstream.requests[0][0]}
    assert all(connection != "close" for _, connection in upstream.requests)


async def test_a_connection_a_probe_opened_is_never_handed_to_a_request(proxy) -> None:
    # The monitor's probes and scrapes go on the client's aiohttp session, requests on its own
    # pool: a probe's kept-alive connection, which this server closes as it is reused, is never
    # the one a request is written to, so no request needs sending again.
    p = await proxy(idle_close=True)
    assert p.http is not None and p.replica.reach is not None
    async with p.http.get(p.replica.reach.url("/health")) as resp:
        assert resp.status == 200
        await resp.read()
    status, body = await p.chat()
    assert answered(status, body, False), (status, body)
    assert [c for c, *_ in p.fake.requests] == [1, 2]
    assert p.replica.failures == 0
