"""A load at startup that failed for a reason that can pass (a provider not up yet) is tried again
with a bounded back-off, shown in the admin row; one that cannot pass without an edit is not; an
admin's load or unload ends the retries. Against the fake supervisord driver, with a real HTTP
provider on loopback (the FAKE one of tests/fakes.py) that starts after the proxy."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp
import pytest

from fakes import FakeProvider, FakeSupervisor
from helpers import free_port
from proxy.config.loading import load_settings
from proxy.lifecycle.placement.load_retry import retry_delay
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState

KEY = "sk-fake-retry"


def remote(port: int, **fields: Any) -> str:
    # `fields` replace the defaults: a key given twice in one mapping is a config error.
    values = {"backend": "openai_remote", "model_path": "null", "remote_api_kind": "chat_completions",
              "remote_base_url": f"'http://127.0.0.1:{port}/v1'", "remote_model": "up-later",
              "remote_api_key_env": "FAKE_KEY", "remote_health_check": "models", "enabled": "true", **fields}
    return "{" + ", ".join(f"{k}: {v}" for k, v in values.items()) + "}"


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[tuple[Pool, int]]:
    port = free_port()
    (tmp_path / "pool.yaml").write_text(
        f"service: {{state_dir: {tmp_path}, load_retry_base_s: 0.05, load_retry_max_s: 0.2}}\n"
        f"engine: {{models: {{relay: {remote(port)}, keyless: {remote(port, remote_api_key_env='UNSET_KEY')}}}}}\n")
    settings = load_settings(tmp_path / "pool.yaml")
    async with aiohttp.ClientSession() as http:
        pool = Pool(settings, FakeSupervisor(), http=http, environ={"FAKE_KEY": KEY})
        yield pool, port
        await pool.close(stop_models=True)


async def until(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
    return value


async def test_a_startup_load_refused_by_a_provider_not_up_yet_is_retried_until_it_loads(
        pool: tuple[Pool, int]) -> None:
    pool_, port = pool
    relay = pool_.models["relay"]
    pool_.load_in_background()
    await until(lambda: relay.state == ModelState.FAILED and relay.load_retry is not None, "a failed first try")
    assert "connection refused" in (relay.last_error or "")
    assert "relay" not in pool_.startup_pending        # /ready waits for the first try only
    await until(lambda: relay.describe()["load_retry"]["attempts"] >= 2, "a second try")   # type: ignore[index]
    row = relay.describe()["load_retry"]
    assert isinstance(row, dict) and set(row) == {"attempts", "next_retry_in_s"}
    provider = FakeProvider(KEY, models=("up-later",), port=port).start()
    try:
        await until(lambda: relay.state == ModelState.LOADED, "the load to succeed")
        assert relay.load_retry is None and relay.describe()["load_retry"] is None and relay.last_error is None
    finally:
        provider.stop()


async def test_the_back_off_doubles_up_to_its_bound(pool: tuple[Pool, int]) -> None:
    pool_, _ = pool
    delays = [retry_delay(pool_.settings.service, attempt) for attempt in range(1, 6)]
    assert delays == [0.05, 0.1, 0.2, 0.2, 0.2]


async def test_a_load_that_cannot_pass_without_an_edit_is_not_retried(pool: tuple[Pool, int]) -> None:
    pool_, _ = pool
    keyless = pool_.models["keyless"]
    pool_.load_in_background()
    await until(lambda: "keyless" not in pool_.startup_pending, "the first try")
    assert keyless.state == ModelState.FAILED and keyless.load_retry is None
    assert "UNSET_KEY" in (keyless.last_error or "")


async def test_an_admin_unload_or_load_ends_the_retries(pool: tuple[Pool, int]) -> None:
    pool_, port = pool
    relay = pool_.models["relay"]
    pool_.load_in_background()
    await until(lambda: relay.load_retry is not None, "a retry pending")
    await pool_.unload("relay")
    assert relay.state == ModelState.UNLOADED and relay.load_retry is None
    await until(lambda: not pool_.retrying(), "the retry to end")
    assert relay.state == ModelState.UNLOADED       # never loaded behind the admin's back
    # A load by the admin that fails is the admin's to retry.
    with pytest.raises(Exception, match="connection refused"):
        await pool_.load("relay")
    assert relay.load_retry is None and not pool_.retrying()
