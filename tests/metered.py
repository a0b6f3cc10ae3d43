"""A pool with one tenant and one model (`metered_pool`: an `openai_remote` model in front of the
FAKE provider, tests/fakes.py; `metered_app`: any model and replica), its routes served in the
test's own process (tests/in_process.py) with the tenants' real SQLite ledger and, as under
`serve`, a handler cancelled when its client hangs up (unless `handler_cancellation` is False).
What each request left in its keys (USAGE, USAGE_ESTIMATED) is kept in `Metered.seen`, in the
order requests finished."""
from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry

from fakes import FakeProvider, FakeSupervisor
from in_process import in_rotation, serve_routes
from proxy.config.loading import load_settings
from proxy.config.model import ModelConfig
from proxy.lifecycle.kinds.remote import RemoteReach
from proxy.lifecycle.kinds.remote_options import Secret
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import Replica
from proxy.serving.forward import upstream_session
from proxy.serving.keys import USAGE, USAGE_ESTIMATED
from proxy.serving.tenancy import Tenancy
from proxy.upstream.reach import Reach

PROVIDER_KEY = "sk-provider-SECRET-5566"
TENANT_KEY = "sk-tenant-SECRET-7788"
MODEL = "r"
HANG_GUARD = aiohttp.ClientTimeout(total=60)


class Metered:
    provider: FakeProvider   # metered_pool's

    def __init__(self, url: str, tenancy: Tenancy, client: aiohttp.ClientSession) -> None:
        self.url, self.tenancy, self.client = url, tenancy, client
        self.seen: list[tuple[str, tuple[int, int, int] | None, bool | None]] = []
        self.requests: list[web.Request] = []   # as they came in
        self.finished = asyncio.Event()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TENANT_KEY}", "X-Allow-Remote": "true"}

    def chat(self, content: str, **fields: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True, **fields}

    async def until_finished(self, requests: int) -> None:
        """Until `requests` requests have ended in the proxy (a hung-up one ends after its client)."""
        async with asyncio.timeout(HANG_GUARD.total):   # a hang guard, not a wait to pass
            while len(self.seen) < requests:
                self.finished.clear()
                await self.finished.wait()

    def ledger(self) -> dict[str, Any]:
        """The tenant's one row of sums in the ledger."""
        self.tenancy.ledger.flush()
        rows = self.tenancy.ledger.usage(None, None, ["tenant"])
        assert len(rows) == 1, rows
        return rows[0]


@contextlib.asynccontextmanager
async def metered_pool(tmp_path: Path, handler_cancellation: bool = True) -> AsyncIterator[Metered]:
    """Model `r`, an `openai_remote` model of the FAKE provider (`Metered.provider`)."""
    provider = FakeProvider(PROVIDER_KEY).start()
    try:
        config = {"backend": "openai_remote", "remote_base_url": provider.url, "remote_model": "gpt-fake",
                  "remote_api_key_env": "PROVIDER_KEY", "remote_health_check": "config_only", "target_inflight": 64}
        async with metered_app(tmp_path, MODEL, config, lambda c: RemoteReach(c, Secret(PROVIDER_KEY)),
                               handler_cancellation) as metered:
            metered.provider = provider
            yield metered
    finally:
        provider.release()
        provider.stop()


@contextlib.asynccontextmanager
async def metered_app(tmp_path: Path, name: str, config: dict[str, Any], reach_of: Callable[[ModelConfig], Reach],
                      handler_cancellation: bool = True) -> AsyncIterator[Metered]:
    """Model `name` (as `config` says) with one replica reached by `reach_of(its config)`, served
    in-process with one tenant (TENANT_KEY) and its ledger."""
    async with contextlib.AsyncExitStack() as stack:
        settings_doc = {"service": {"state_dir": str(tmp_path)}, "engine": {"models": {name: config}},
                        "tenants": {"t": {"key_env": ["T_KEY"], "fairness_key": "t", "allow_remote": True}}}
        (tmp_path / "pool.yaml").write_text(json.dumps(settings_doc))
        settings = load_settings(tmp_path / "pool.yaml")
        tenancy = Tenancy.open(settings, {"T_KEY": TENANT_KEY}, CollectorRegistry())
        stack.callback(tenancy.close)
        http = await stack.enter_async_context(upstream_session())
        pool = Pool(settings, FakeSupervisor(), http, environ={})  # type: ignore[arg-type]
        in_rotation(pool, name, [Replica(model=name, index=0, reach=reach_of(settings.models[name]))])
        metered: Metered | None = None

        @web.middleware
        async def note(request: web.Request, handler: Handler) -> web.StreamResponse:
            assert metered is not None
            metered.requests.append(request)
            try:
                return await handler(request)
            finally:
                metered.seen.append((request.path, request.get(USAGE), request.get(USAGE_ESTIMATED)))
                metered.finished.set()

        url = await serve_routes(stack, settings, pool, http, tenancy=tenancy,
                                 handler_cancellation=handler_cancellation, outer=[note])
        client = await stack.enter_async_context(aiohttp.ClientSession(timeout=HANG_GUARD))
        metered = Metered(url, tenancy, client)
        yield metered


def content_of(data: bytes) -> str:
    """The text of one OpenAI stream chunk's `data:` payload ("" for one without)."""
    chunk = json.loads(data)
    return "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices") or [])
