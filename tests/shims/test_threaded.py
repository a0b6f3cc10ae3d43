"""TokenPipe: a blocking engine call in a worker thread, read as an async iterator."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from shims.threaded import TokenPipe


def producer(release: threading.Event, returned: threading.Event):
    """Emits until its reader goes, then holds on (an engine finishing its step) until released."""
    def produce(pipe: TokenPipe[str]) -> None:
        while pipe.emit("t"):
            pass
        release.wait(60)
        returned.set()
    return produce


async def test_a_reader_that_leaves_waits_for_the_engine_even_when_cancelled_meanwhile() -> None:
    # A streaming client that leaves: the write fails, the generator is closed, and while it waits
    # for the engine the server cancels the handler too. It must still wait, or the engine's gauges
    # and counters are read while the engine is still at work.
    release, returned = threading.Event(), threading.Event()
    pipe: TokenPipe[str] = TokenPipe(asyncio.get_running_loop())
    with ThreadPoolExecutor(1) as executor:
        batches = pipe.run(executor, producer(release, returned))
        assert await anext(batches)
        closing = asyncio.create_task(batches.aclose())
        await asyncio.sleep(0)
        closing.cancel()
        for _ in range(5):
            await asyncio.sleep(0)
        ended_early = closing.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await closing
    assert not ended_early
    assert returned.is_set() and pipe.abandoned


async def test_a_reader_that_reads_to_the_end_has_not_abandoned() -> None:
    pipe: TokenPipe[str] = TokenPipe(asyncio.get_running_loop())

    def produce(p: TokenPipe[str]) -> None:
        for _ in range(3):
            p.emit("t")

    with ThreadPoolExecutor(1) as executor:
        async with contextlib.aclosing(pipe.run(executor, produce)) as batches:
            tokens = [t async for batch in batches for t in batch]
    assert tokens == ["t"] * 3 and not pipe.abandoned
