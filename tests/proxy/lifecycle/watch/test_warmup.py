"""Warm-up requests against a real HTTP server on loopback: the chat completion first, a plain
completion where chat is refused, and the reason when a generation fails."""
from __future__ import annotations

from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from helpers import free_port
from launchers.spec import ProgramSpec
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import Replica
from proxy.lifecycle.watch.warmup import warm_up


@pytest.fixture
async def server() -> AsyncIterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """A server whose answer per path the test sets: {path: status}; the requests it got, in order."""
    answers: dict[str, Any] = {}
    seen: list[dict[str, Any]] = []

    async def post(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"path": request.path, "body": body, "id": request.headers.get("X-Request-Id", "")})
        status = answers.get(request.path, 200)
        if status != 200:
            return web.json_response({"error": {"message": f"no {request.path} here", "code": "x"}}, status=status)
        return web.json_response({"choices": [{"text": "a"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_route("POST", "/{tail:.*}", post)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    answers["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield answers, seen
    await runner.cleanup()


def replica(port: int) -> Replica:
    spec = ProgramSpec(program="m-0", argv=(), env=(), host="127.0.0.1", port=port, health_path="/health",
                       models_path=None, served_model="served-m", start_timeout_s=5, stopwaitsecs=5)
    return Replica(model="m", index=0, spec=spec, reach=ProgramReach(spec))


async def test_one_token_of_chat_with_the_served_model_name(server: Any) -> None:
    answers, seen = server
    async with aiohttp.ClientSession() as http:
        seconds, error = await warm_up(http, replica(answers["port"]), 5)
    assert error is None and seconds is not None and seconds > 0
    (request,) = seen
    assert request["path"] == "/v1/chat/completions" and request["id"].startswith("llm-pool-warmup-")
    assert request["body"]["max_tokens"] == 1 and request["body"]["model"] == "served-m"


async def test_a_server_that_refuses_chat_is_warmed_with_a_completion(server: Any) -> None:
    answers, seen = server
    answers["/v1/chat/completions"] = 400   # e.g. vLLM on a model without a chat template
    async with aiohttp.ClientSession() as http:
        seconds, error = await warm_up(http, replica(answers["port"]), 5)
    assert error is None and seconds is not None
    assert [r["path"] for r in seen] == ["/v1/chat/completions", "/v1/completions"]
    assert seen[1]["body"]["prompt"] and seen[1]["body"]["max_tokens"] == 1


async def test_a_failed_generation_is_the_reason_and_not_retried_elsewhere(server: Any) -> None:
    answers, seen = server
    answers["/v1/chat/completions"] = 500
    async with aiohttp.ClientSession() as http:
        seconds, error = await warm_up(http, replica(answers["port"]), 5)
    assert seconds is None and error is not None
    assert "HTTP 500" in error and "no /v1/chat/completions here" in error
    assert len(seen) == 1


async def test_a_server_that_is_gone_is_the_reason(server: Any) -> None:
    answers, _seen = server
    async with aiohttp.ClientSession() as http:
        seconds, error = await warm_up(http, replica(free_port()), 5)
    assert seconds is None and error is not None and error.startswith("warm-up request failed: ClientConnectorError")
