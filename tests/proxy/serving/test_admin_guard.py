"""The admin guard's rules, on a real aiohttp server on port 0 with raw requests (every header byte as
a browser or an attacker would send it). tests/integration/test_admin_auth.py runs them through a
real proxy."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.loading import load_settings
from proxy.serving.admin_guard import admit
from proxy.serving.errors_http import error_middleware
from proxy.serving.keys import SETTINGS

TOKEN_VAR = "LLM_POOL_TEST_GUARD_TOKEN"


async def _guarded(request: web.Request) -> web.Response:
    admit(request)
    return web.json_response({"ok": True})


async def _serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **service: Any) -> AsyncIterator[int]:
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(tmp_path / "no-local.yaml"))
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"service": {"state_dir": str(tmp_path / "state"), **service}}))
    app = web.Application(middlewares=[error_middleware])
    app[SETTINGS] = load_settings(path)
    app.router.add_route("*", "/v1/admin/x", _guarded)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield server.port or 0
    await server.close()


@pytest.fixture
async def open_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    """No token; service.host is a name the admin chose."""
    async for port in _serve(tmp_path, monkeypatch, host="pool.lan"):
        yield port


@pytest.fixture
async def token_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    monkeypatch.setenv(TOKEN_VAR, "tok")
    async for port in _serve(tmp_path, monkeypatch, admin_token_env=TOKEN_VAR):
        yield port


async def ask(port: int, method: str, headers: dict[str, bytes], body: bytes = b"") -> tuple[int, Any]:
    """One raw HTTP/1.1 request: the headers go out exactly as given (none added, Host included)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"".join(k.encode() + b": " + v + b"\r\n" for k, v in headers.items())
    writer.write(f"{method} /v1/admin/x HTTP/1.1\r\n".encode() + head +
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    answer = await reader.read()
    writer.close()
    status = int(answer.split(b" ", 2)[1])
    payload = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    return status, payload if status == 200 else payload["error"]["code"]


@pytest.mark.parametrize("host", [b"127.0.0.1:8011", b"127.9.9.9", b"localhost:1", b"LocalHost", b"[::1]:8011",
                                  b"192.0.2.7:8011", b"pool.lan:8011", b"POOL.LAN"])
async def test_without_a_token_addresses_localhost_and_the_configured_name_are_served(
        open_port: int, host: bytes) -> None:
    assert await ask(open_port, "GET", {"Host": host}) == (200, {"ok": True})


@pytest.mark.parametrize("host", [b"evil.example", b"evil.example:8011", b"localhost.evil.example",
                                  b"127.0.0.1.nip.io", b"pool.lan.evil.example", b"\xff"])
async def test_without_a_token_another_name_is_refused(open_port: int, host: bytes) -> None:
    assert await ask(open_port, "GET", {"Host": host}) == (403, "host_not_allowed")


@pytest.mark.parametrize(("origin", "extra", "expected"), [
    (b"http://127.0.0.1:8011", {}, 200),
    (b"http://127.0.0.1:9999", {}, "origin_not_allowed"),          # another port is another origin
    (b"http://evil.example", {}, "origin_not_allowed"),
    (b"null", {}, "origin_not_allowed"),                            # a sandboxed frame, a file: page
    (b"http://127.0.0.1:8011/x", {}, "origin_not_allowed"),         # no origin has a path
    (b"ftp://127.0.0.1:8011", {}, "origin_not_allowed"),
    # Behind a reverse proxy that rewrites Host: the name the browser used is X-Forwarded-Host.
    (b"https://pool.example", {"X-Forwarded-Host": b"pool.example"}, 200),
    (b"https://evil.example", {"X-Forwarded-Host": b"pool.example"}, "origin_not_allowed"),
])
async def test_an_origin_is_served_only_when_it_is_this_listeners_own(
        open_port: int, origin: bytes, extra: dict[str, bytes], expected: int | str) -> None:
    headers = {"Host": b"127.0.0.1:8011", "Origin": origin, **extra}
    status, answer = await ask(open_port, "GET", headers)
    assert (status if status == 200 else answer) == expected


@pytest.mark.parametrize(("content_type", "expected"), [
    (b"application/json", 200), (b"application/json; charset=utf-8", 200), (b"Application/JSON", 200),
    (b"text/plain", "unsupported_media_type"), (b"text/plain; charset=utf-8", "unsupported_media_type"),
    (b"application/x-www-form-urlencoded", "unsupported_media_type"),
    (b"multipart/form-data; boundary=x", "unsupported_media_type"), (None, "unsupported_media_type"),
    (b"application/json-seq", "unsupported_media_type"),
])
async def test_a_post_is_served_only_as_json(open_port: int, content_type: bytes | None, expected: int | str) -> None:
    headers = {"Host": b"localhost"} | ({"Content-Type": content_type} if content_type is not None else {})
    status, answer = await ask(open_port, "POST", headers, b"{}")
    assert (status if status == 200 else answer) == expected


@pytest.mark.parametrize(("authorization", "expected"), [
    (b"Bearer tok", 200), (b"bearer tok", 200),
    (b"Bearer \xff", "invalid_admin_token"), (b"Bearer tok\xff", "invalid_admin_token"),
    (b"Bearer \xc3\xa9", "invalid_admin_token"), (b"Basic tok", "invalid_admin_token"),
    (b"Bearer", "invalid_admin_token"), (b"tok", "invalid_admin_token"), (b"", "invalid_admin_token"),
])
async def test_with_a_token_a_malformed_authorization_is_401(
        token_port: int, authorization: bytes, expected: int | str) -> None:
    status, answer = await ask(token_port, "GET", {"Host": b"any.name.example", "Authorization": authorization})
    assert (status if status == 200 else answer) == expected
    assert status in (200, 401)


async def test_with_a_token_a_foreign_origin_is_still_refused(token_port: int) -> None:
    headers = {"Host": b"localhost", "Authorization": b"Bearer tok", "Origin": b"http://evil.example"}
    assert await ask(token_port, "POST", {**headers, "Content-Type": b"application/json"}) == \
        (403, "origin_not_allowed")
