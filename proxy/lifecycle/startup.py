"""The loads a serve starts with, and those of them tried again.

At startup the pool loads its enabled models and adopts any configured model whose replicas still
run (proxy/lifecycle/pool.py decides which). A first load that fails in a way that can pass
without an edit (load_retry.worth_retrying) is tried again after load_retry.retry_delay, for as
long as it fails, until an admin loads or unloads the model: that ends its retries. Until its first
try has ended a model is `pending`: /ready waits for it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Mapping

from launchers.spec import replica_index
from proxy.config.settings import ServiceSettings
from proxy.lifecycle.kept import KeptModels
from proxy.lifecycle.kinds.process_table import live
from proxy.lifecycle.placement.load_retry import retry_delay, worth_retrying
from proxy.lifecycle.state.runtime import LoadRetry, ModelRuntime
from proxy.supervisord.supervisor import ProcessInfo

log = logging.getLogger(__name__)


class StartupLoads:
    def __init__(self, models: Mapping[str, ModelRuntime], service: ServiceSettings) -> None:
        self.models = models
        self.service = service
        # Models whose first load at startup has not finished (loaded or failed): /ready waits for them.
        self.pending: set[str] = set()
        # Startup loads that failed and are tried again, until they load or an admin steps in.
        self._retries: dict[str, LoadRetry] = {}

    def adopting(self, processes: Mapping[str, ProcessInfo]) -> frozenset[str]:
        """The configured models with replicas running in `processes` (the programs' last look at
        supervisord): those the startup adopts."""
        running = {i.group for i in processes.values() if live(i)}
        return frozenset(name for name in self.models if any(replica_index(name, g) is not None for g in running))

    def to_load(self, running: frozenset[str], kept: KeptModels) -> list[tuple[str, bool, dict[str, Any]]]:
        """The models to load at startup, each `pending` from now: the enabled ones, and any other
        whose replicas are `running` (an admin loaded it before the proxy restarted), with whether
        it is adopted and what the last proxy kept of an admin's overrides for it (kept.py)."""
        entries = kept.read()
        out = []
        for runtime in self.models.values():
            adopting = runtime.name in running
            if runtime.config.enabled or adopting:
                self.pending.add(runtime.name)
                out.append((runtime.name, adopting, kept.honour(runtime, entries.pop(runtime.name, None))))
        for name in sorted(entries):
            log.info("model %s is not loaded at startup: its kept overrides are dropped", name)
        return out

    def retrying(self) -> list[str]:
        """The models whose failed startup load is being tried again."""
        return sorted(self._retries)

    def stop_retry(self, name: str) -> None:
        """An admin loads or unloads `name`: its startup load is not tried again."""
        retry = self._retries.pop(name, None)
        if retry is not None:
            retry.stopped.set()
            self.models[name].load_retry = None
            log.info("model %s: no more load retries, an admin loads or unloads it", name)

    async def load(self, name: str, attempt: Callable[[], Awaitable[object]]) -> None:
        """Load `name` at startup by `attempt` (one try: the pool's load, with what the last proxy
        kept of an admin's overrides), again after each failure worth retrying, until it loads, the
        failure is one no wait mends, or an admin loads or unloads the model."""
        runtime = self.models[name]
        retry = self._retries[name] = LoadRetry()
        try:
            while True:
                try:
                    await attempt()
                    return
                except Exception as exc:
                    # A load refused before it began (e.g. not loadable) left no error on the model: /ready shows it.
                    runtime.last_error = runtime.last_error or str(exc)
                    if retry.stopped.is_set() or not worth_retrying(exc):
                        log.error("loading %s failed: %s", name, exc)
                        return
                    retry.attempts += 1
                    delay = retry_delay(self.service, retry.attempts)
                    log.error("loading %s failed (try %d): %s; trying again in %gs", name, retry.attempts, exc, delay)
                finally:
                    self.pending.discard(name)
                retry.next_at = time.monotonic() + delay
                runtime.load_retry = retry
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await retry.stopped.wait()
                if retry.stopped.is_set():
                    return
                retry.next_at = None
        finally:
            if self._retries.get(name) is retry:
                del self._retries[name]
                runtime.load_retry = None
