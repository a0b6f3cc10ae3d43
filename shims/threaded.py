"""A blocking, token-at-a-time engine call run in a worker thread and read as an async iterator.

CTranslate2 and llama-cpp-python generate in blocking calls (their async variants would block the
event loop). The call runs in an executor thread and hands each token to `emit`, which returns
False once the reader has gone: the engine's loop (or CT2's callback) stops there, so a client that
leaves stops the engine's work, not only the HTTP write. Tokens made while the loop was busy are
delivered together, one wake-up for many, so the thread hop costs little per token.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from concurrent.futures import Executor
from typing import AsyncGenerator, Callable, Generic, TypeVar

T = TypeVar("T")
_DONE = object()


class TokenPipe(Generic[T]):
    """One generation's tokens from a worker thread to the event loop, with a stop signal back."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[object] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.stopped = threading.Event()   # set when the reader has gone: the producer must stop
        # The reader left before the producer's last word. Read on the event loop once `run` has
        # returned, so a count made from it agrees with the engine's other counters.
        self.abandoned = False

    # -- the worker thread's side ----------------------------------------------------------------

    def emit(self, item: T) -> bool:
        """Queue one token; False when the reader has gone and the engine should stop."""
        self._push(item)
        return not self.stopped.is_set()

    def finish(self) -> None:
        """The generation is over (the producer's last word)."""
        self._push(_DONE)

    def fail(self, exc: BaseException) -> None:
        """The generation failed; the reader raises `exc`."""
        self._push(_Failure(exc))

    def _push(self, item: object) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    # -- the event loop's side -------------------------------------------------------------------

    async def _drain(self) -> list[object]:
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    return items
                waiter = self._waiter = self._loop.create_future()
            await waiter

    async def run(self, executor: Executor | None,
                  produce: Callable[["TokenPipe[T]"], None]) -> AsyncGenerator[list[T], None]:
        """Run `produce(self)` in `executor` and yield what it emits, in batches, until it returns or raises.

        Leaving early (the reader closed or cancelled) sets `stopped` and waits for the producer to
        notice, so the engine is idle again when this generator is closed.
        """
        def work() -> None:
            try:
                produce(self)
            except BaseException as exc:  # delivered to the reader, raised there
                self.fail(exc)
            else:
                self.finish()

        future = self._loop.run_in_executor(executor, work)
        try:
            async with contextlib.aclosing(self.stream()) as items:
                async for item in items:
                    yield item
        except (GeneratorExit, asyncio.CancelledError):
            self.abandoned = True
            raise
        finally:
            self.stopped.set()
            await _outlast_cancellation(future)

    async def stream(self) -> AsyncGenerator[list[T], None]:
        """What the producer emits, until it finishes or fails; leaving early sets `stopped`.

        Each batch is everything emitted since the reader last looked, so a fast engine costs one
        wake-up (and one socket write downstream) per batch rather than per token.
        """
        try:
            while True:
                batch: list[T] = []
                for item in await self._drain():
                    if item is _DONE or isinstance(item, _Failure):
                        if batch:
                            yield batch
                        if isinstance(item, _Failure):
                            raise item.exc
                        return
                    batch.append(item)  # type: ignore[arg-type]
                if batch:
                    yield batch
        finally:
            self.stopped.set()


async def _outlast_cancellation(future: asyncio.Future[None]) -> None:
    """Wait for the engine to let go of the request, even through cancellations, then re-raise one.

    A reader that leaves is often cancelled twice: its write fails, and while it waits here the
    server cancels the handler for the lost connection. The producer stops at its next token, so
    the wait is short, and only after it are the engine's gauges and counters true again.
    """
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
