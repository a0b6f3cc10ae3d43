"""A tenant that asks for a model that is not loaded (and does not load on demand) is told so and to
ask the pool's admin: a tenant is no admin, so it is not pointed at the admin API. Real HTTP: the
proxy's routes with tenants and a real SQLite ledger (tests/in_process.py)."""
from __future__ import annotations

import contextlib
from pathlib import Path

import aiohttp

from fakes import FakeProvider
from in_process import tenant_proxy
from metered import PROVIDER_KEY
from proxy.lifecycle.state.replicas import ModelState

KEY = "sk-tenant-SECRET-3141"


async def test_a_tenant_asking_for_an_unloaded_model_is_told_to_ask_the_admin(
        tmp_path: Path, provider: FakeProvider, stack: contextlib.AsyncExitStack) -> None:
    url, _, pool = await tenant_proxy(stack, tmp_path, provider.url, PROVIDER_KEY, {"t": {"key": KEY}})
    runtime = pool.models["r"]
    runtime.state, runtime.replicas = ModelState.UNLOADED, []   # as after an admin's unload
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        async with client.post(url + "/v1/chat/completions",
                               json={"model": "r", "messages": [{"role": "user", "content": "hi"}]},
                               headers={"Authorization": f"Bearer {KEY}", "X-Allow-Remote": "true"}) as resp:
            status, error = resp.status, (await resp.json())["error"]
    assert (status, error["code"], error["param"]) == (409, "model_not_loaded", "model")
    assert error["message"] == "model 'r' is configured but not loaded; ask the pool's admin to load it"
    assert provider.requests == []
