"""Per-model admission: a request takes a slot before it is sent to a replica.

Capacity is the sum of `target_inflight` over READY replicas and changes as replicas come and go.
Requests over capacity wait in arrival order. Waiters are futures: a client that goes away while
waiting leaves the queue, and a waiter cancelled just after it was handed a slot gives the slot
to the next in line instead of stranding it.
"""
from __future__ import annotations

import asyncio
from collections import deque

from proxy.errors import PoolError


class FifoAdmission:
    def __init__(self) -> None:
        self.capacity = 0
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed: PoolError | None = None

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        self._wake()

    async def acquire(self) -> None:
        if self._closed is not None:
            raise self._closed
        if self.active < self.capacity and not self.waiting:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # We were handed a slot but can no longer take it: pass it on.
                self.release()
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self) -> None:
        self.active -= 1
        self._wake()

    def close(self, error: PoolError) -> None:
        """Refuse new requests and fail every waiter with `error`; running ones finish."""
        self._closed = error
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error)

    def _wake(self) -> None:
        while self.active < self.capacity and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self.active += 1
                fut.set_result(None)
