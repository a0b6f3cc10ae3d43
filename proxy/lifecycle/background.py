"""The pool's background tasks: what runs on after the call that started it (a load on demand,
a startup load and its retries, a roll, a measurement), until it ends or the pool closes."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> "asyncio.Task[T]":
        """Run `coro` until it ends or `cancel_all`."""
        return self.add(asyncio.create_task(coro))

    def add(self, task: "asyncio.Task[T]") -> "asyncio.Task[T]":
        """Hold `task` until it ends or `cancel_all`."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def detached(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run an admin load or unload to its end even if the caller is cancelled (its client
        left): half a load or unload would leave the model LOADING or UNLOADING for good."""
        task = self.spawn(coro)
        # Retrieved even when no one awaits it any more, so its failure is not reported as lost.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(task)

    async def cancel_all(self) -> None:
        """Cancel every task and wait until each has ended."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
