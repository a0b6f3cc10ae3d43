"""A data-plane key that is not UTF-8 (issue 39, item 11): `Authorization` or `x-api-key` bytes that
do not decode are a wrong key, 401 `invalid_api_key`, never a 500, as on the admin API. Real HTTP on
loopback with raw header bytes (aiohttp keeps undecodable bytes as surrogates), in front of the
proxy's own routes with tenants."""
from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import yaml
from prometheus_client import CollectorRegistry

from fakes import FakeSupervisor
from in_process import serve_routes
from proxy.config.loading import load_settings
from proxy.lifecycle.pool import Pool
from proxy.serving.forward import upstream_session
from proxy.serving.tenancy import Tenancy

KEY = "sk-tenant-a-key"


@pytest.fixture
async def port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(tmp_path / "no-local.yaml"))
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump({
        "service": {"state_dir": str(tmp_path)},
        "engine": {"models": {"m": {"backend": "sim", "enabled": True}}},
        "tenants": {"a": {"key_env": ["TENANT_A_KEY"], "fairness_key": "a"}}}))
    settings = load_settings(tmp_path / "pool.yaml")
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(upstream_session())
        pool = Pool(settings, FakeSupervisor(), http, environ={})  # type: ignore[arg-type]
        tenancy = Tenancy.open(settings, {"TENANT_A_KEY": KEY}, CollectorRegistry())
        stack.callback(tenancy.close)
        url = await serve_routes(stack, settings, pool, http, tenancy=tenancy)
        yield int(url.rsplit(":", 1)[1])


async def ask(port: int, headers: dict[str, bytes]) -> tuple[int, Any]:
    """One raw HTTP/1.1 chat request; the headers go out exactly as given."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"".join(k.encode() + b": " + v + b"\r\n" for k, v in headers.items())
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
                 head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    answer = await reader.read()
    writer.close()
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


@pytest.mark.parametrize("headers", [
    {"Authorization": b"Bearer \xff"},
    {"Authorization": b"Bearer " + KEY.encode() + b"\xfe\xff"},
    {"Authorization": b"Bearer \xc3\x28"},          # a truncated two-byte sequence
    {"Authorization": b"Bearer \xed\xa0\x80"},      # an encoded surrogate: no valid UTF-8 either
    {"x-api-key": b"\xff\xfe"},
    {"Authorization": b"Basic \xff", "x-api-key": b"sk-\x80"},
])
async def test_an_undecodable_key_is_401_invalid_api_key(port: int, headers: dict[str, bytes]) -> None:
    assert await ask(port, headers) == (401, "invalid_api_key")


async def test_a_valid_key_still_passes_and_a_wrong_ascii_one_does_not(port: int) -> None:
    # Past the key check, the model (not loaded, not on demand here) answers for itself.
    status, code = await ask(port, {"Authorization": b"Bearer " + KEY.encode()})
    assert (status, code) != (401, "invalid_api_key") and status < 500
    assert await ask(port, {"Authorization": b"Bearer sk-other"}) == (401, "invalid_api_key")
    assert await ask(port, {"x-api-key": "sk-é".encode()}) == (401, "invalid_api_key")
