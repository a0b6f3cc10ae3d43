"""A call to look again now, for one loop that sleeps between its passes (the monitor's poll, the
placer's planning).

Built before the loop that waits on it and before those that call it, and handed to each, so that
neither has to exist first: the programs that start a process wake the monitor without knowing it,
and the build order is written in the constructor calls, not in lambdas that read an attribute set
later. One per loop: a loop clears its own wake-up, so two loops on one would lose each other's.
"""
from __future__ import annotations

import asyncio
import contextlib


class Wake:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def __call__(self) -> None:
        """Look again now (or as soon as the current pass ends)."""
        self._event.set()

    def clear(self) -> None:
        """Forget the calls so far: a pass that starts now sees what they were about."""
        self._event.clear()

    async def wait(self, timeout_s: float | None) -> None:
        """Until a call comes, or `timeout_s` has passed (None: only a call)."""
        # asyncio.timeout, not wait_for: a stop's cancel is never lost.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._event.wait()
