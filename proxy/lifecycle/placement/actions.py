"""What the placer is handed at construction: the actions it carries its decisions out with, and
the clock it reads.

The placer decides (proxy/lifecycle/placement/placer.py); every side effect of a decision, a load,
an unload, a task that runs on, goes through `PlacerActions`, as llama-swap's scheduler makes its
effects through one interface. The pool implements it (proxy/lifecycle/pool.py); the placer's unit
tests hand it a recording fake (tests/fakes.py), and a clock they move themselves.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Coroutine, Protocol


class PlacerActions(Protocol):
    # Set while no earlier proxy process may still send requests to the replicas (a reload's
    # predecessor has exited): until then the placer unloads nothing.
    predecessor_gone: asyncio.Event

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> object:
        """Run `coro` in the background until it ends or the pool closes."""

    async def load_placed(self, name: str, evict: tuple[str, ...]) -> object:
        """A load on demand placement admitted: evict `evict` (through the placer's make_room),
        then load the model with its configured settings. Raises what the load failed with."""

    async def unload_by_pool(self, name: str, reason: str, cause: str | None = None) -> object:
        """Unload as placement decided (`reason`: idle, evicted; `cause`: the model it makes room
        for, or how long it was idle): drained, its waiters kept queued. Raises Conflict when the
        model is not loaded (another unload got there first)."""


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds: last uses (kept across restarts) and back-offs are in these."""

    def monotonic(self) -> float:
        """Seconds for intervals: how long a load has waited for room, a model has been loaded."""


class SystemClock:
    """The clock the proxy runs on."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()
