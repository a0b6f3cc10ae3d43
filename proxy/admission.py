"""Per-model admission: the async face of the fairness scheduler.

A request takes a slot before it is sent to a replica. Capacity is the sum of `target_inflight`
over READY replicas and changes as replicas come and go. Waiters are futures: a client that goes
away while waiting leaves its queue, one that goes away while running frees its slot (its running
time still counts to its key), and a waiter cancelled just after it was handed a slot gives the
slot back to the scheduler instead of stranding it. A waiter that has waited `max_wait_s` gives up
its place the same way and fails with 503 `queue_timeout` (or with its stall, the pool's reason why
a model that is not loaded cannot load yet: 503 `insufficient_memory`, given through `set_stall`).

The queue outlives loads: requests for a model that is not loaded wait in it while the pool loads
the model (load on demand), and `hold` stops granting slots without failing the waiters while the
pool unloads a model to make room, so that they wait for its next load instead.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Callable, Hashable, Iterable

from proxy.errors import PoolError, TooManyRequests, Unavailable
from proxy.fairness import ANONYMOUS, DEFAULT_CLASS, FairnessPolicy, FairScheduler, QueueFull


# engine.fairness.max_queue_wait_s when unset; null in the settings waits forever.
DEFAULT_MAX_QUEUE_WAIT_S = 120.0


class Admission:
    def __init__(self, policy: FairnessPolicy | None = None, clock: Callable[[], float] = time.monotonic,
                 max_wait_s: float | None = None) -> None:
        self.scheduler = FairScheduler(policy or FairnessPolicy(), clock)
        self.max_wait_s = max_wait_s
        self._granted: dict[Hashable, asyncio.Future[None]] = {}
        self._ids = itertools.count()
        self._closed: PoolError | None = None
        self._held = False
        self._capacity = 0
        self._timer: asyncio.TimerHandle | None = None
        # Wall-clock time of the last request's arrival or end (or an admin load): idle unload
        # counts from it, and it is kept across restarts.
        self.last_used = 0.0
        # Why a waiter's wait can run out before the model loads (the pool's placement says, set_stall).
        self._stall: PoolError | None = None
        # The listeners (listen): a request had to wait (the model may need loading); the queue went idle.
        self._on_queued: Callable[[], None] | None = None
        self._on_idle: Callable[[], None] | None = None

    def listen(self, on_queued: Callable[[], None] | None = None, on_idle: Callable[[], None] | None = None) -> None:
        """Be told when a request has to wait (`on_queued`: the model may need loading) and when
        nothing runs or waits any more (`on_idle`). Called synchronously, on the event loop."""
        self._on_queued, self._on_idle = on_queued, on_idle

    @property
    def stall(self) -> PoolError | None:
        return self._stall

    def set_stall(self, error: PoolError | None) -> None:
        """Why a waiter's wait may run out before the model loads (it cannot load yet: 503
        `insufficient_memory`): what a wait that runs out raises instead of `queue_timeout`. None:
        a wait that runs out is a plain `queue_timeout` again."""
        self._stall = error

    @property
    def capacity(self) -> int:
        return self.scheduler.capacity

    @property
    def active(self) -> int:
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    def set_capacity(self, capacity: int) -> None:
        self._capacity = capacity
        if not self._held:
            self._start(self.scheduler.set_capacity(capacity))

    def hold(self) -> None:
        """Grant no more slots, and keep the waiters: they wait for the model's next load."""
        self._held = True
        self.scheduler.set_capacity(0)

    def reopen(self) -> None:
        """Take requests again after `close` or `hold` (the model loads again)."""
        self.accept()
        if self._held:
            self._held = False
            self._start(self.scheduler.set_capacity(self._capacity))

    def accept(self) -> None:
        """Let requests queue again after `close`; a `hold` stays: they wait for the next load."""
        self._closed = None

    @property
    def closed(self) -> PoolError | None:
        return self._closed

    def describe(self) -> dict[str, object]:
        """Whether requests may queue; when not, the error each one gets (the admin view shows it:
        a closed queue refuses every request whatever the model's state says)."""
        closed = self._closed
        return {"open": closed is None, "code": closed.code if closed else None,
                "reason": closed.message if closed else None}

    def oldest_wait_s(self) -> float:
        """How long the longest-waiting request has waited; 0 when none waits."""
        if not self.scheduler.waiting:
            return 0.0
        now = time.monotonic()
        return max((now - t[2] for t, fut in self._granted.items()
                    if not fut.done() and isinstance(t, tuple) and len(t) == 3), default=0.0)

    def enqueue(self, key: str = ANONYMOUS,
                priority: str = DEFAULT_CLASS) -> tuple[Hashable, "asyncio.Future[None] | None"]:
        """Join the queue of priority class `priority` now: raises at once (429) if it may not wait.
        Then `wait` for the slot. A request granted its slot as it joins (the common case) gets no
        future: there is nothing to wait for."""
        if self._closed is not None:
            raise self._closed
        ticket = (key, next(self._ids), time.monotonic())
        try:
            started = self.scheduler.submit(ticket, key, self.scheduler.policy.rank(priority))
        except QueueFull as full:
            raise TooManyRequests(str(full), code=full.code, retry_after=full.retry_after) from None
        self.last_used = time.time()
        if ticket in started:
            if len(started) > 1:
                self._start(t for t in started if t is not ticket)
            return ticket, None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._granted[ticket] = fut
        self._start(started)
        if self._on_queued is not None:
            self._on_queued()
        return ticket, fut

    async def wait(self, queued: tuple[Hashable, "asyncio.Future[None] | None"]) -> Hashable:
        ticket, fut = queued
        if fut is None:
            return ticket
        try:
            # shield: the timeout must not cancel the future itself, so that a slot granted in the
            # same instant is seen (and passed on) by `abandon` below. asyncio.timeout, not wait_for:
            # on 3.11 wait_for swallows a cancellation that lands as the slot is granted, and the
            # handler of a client that has left would go on to run its request.
            async with asyncio.timeout(self.max_wait_s):
                await asyncio.shield(fut)
        except TimeoutError:
            self.abandon(queued)
            if self._stall is not None:
                raise self._stall from None
            raise Unavailable(f"no slot freed within {self.max_wait_s:g}s (engine.fairness.max_queue_wait_s)",
                              code="queue_timeout",
                              retry_after=self.scheduler.retry_after(self.scheduler.waiting)) from None
        except BaseException:
            # Cancelled while waiting (the client left) or failed by `close`: whether still queued or
            # already handed a slot, the scheduler forgets it and passes any slot on.
            self.abandon(queued)
            raise
        return ticket

    def abandon(self, queued: tuple[Hashable, "asyncio.Future[None] | None"]) -> None:
        """Give up a place from `enqueue` without waiting for it (the request ended first)."""
        ticket, _fut = queued
        self._granted.pop(ticket, None)
        self._start(self.scheduler.cancel(ticket))
        self._maybe_idle()

    async def acquire(self, key: str = ANONYMOUS, priority: str = DEFAULT_CLASS) -> Hashable:
        """Wait for a slot; returns the ticket to hand back to `release`."""
        return await self.wait(self.enqueue(key, priority))

    def release(self, ticket: Hashable, completed: bool = True) -> None:
        """The request ended: `completed` when it ran to its end, False when its client left."""
        self._granted.pop(ticket, None)
        events = self.scheduler.done(ticket) if completed else self.scheduler.cancel(ticket)
        self._start(events)
        self.last_used = time.time()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self._on_idle is not None and not self.scheduler.running and not self.scheduler.waiting:
            self._on_idle()

    def close(self, error: PoolError) -> None:
        """Refuse new requests and fail every waiter with `error`; running ones finish."""
        self._closed = error
        for ticket in self.scheduler.drop_waiting():
            fut = self._granted.pop(ticket, None)
            if fut is not None and not fut.done():
                fut.set_exception(error)

    def describe_keys(self) -> dict[str, dict[str, float | str]]:
        """The most active fairness keys (a bounded list, whatever clients send)."""
        return self.scheduler.keys()

    def key_counts(self) -> dict[str, int]:
        return self.scheduler.key_counts()

    def describe_classes(self) -> dict[str, dict[str, float | None]]:
        return self.scheduler.classes()

    def _start(self, tickets: Iterable[Hashable]) -> None:
        for ticket in tickets:
            fut = self._granted.get(ticket)
            if fut is not None and not fut.done():
                fut.set_result(None)
        # A slot held for a key (anticipation) must be released to the others when it expires,
        # even if no other event comes: wake the scheduler then.
        wakeup = self.scheduler.next_wakeup()
        if wakeup is not None and self._timer is None:
            delay = max(0.0, wakeup - self.scheduler.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._start(self.scheduler.tick())
