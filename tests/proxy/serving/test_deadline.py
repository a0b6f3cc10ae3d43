"""relay.Deadline, the first-byte bound of every upstream send: what asyncio.timeout promises, in a
plain `with`. Time runs out on a future that never completes; nothing here sleeps to pass."""
from __future__ import annotations

import asyncio

import pytest

from proxy.edge.relay import Deadline


async def test_an_answer_in_time_is_kept_and_leaves_no_cancellation_behind() -> None:
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    done.set_result("ok")
    with Deadline(60):
        assert await done == "ok"
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)        # a cancellation left pending would land here


async def test_no_answer_in_time_is_a_timeout_error_and_its_cancellation_is_taken_back() -> None:
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(TimeoutError):
        with Deadline(0.01):
            await never
    assert never.cancelled()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    # The client left while the send was waiting: the handler is cancelled; it does not time out.
    started = asyncio.Event()

    async def waiter() -> None:
        with Deadline(60):
            started.set()
            await asyncio.get_running_loop().create_future()

    task = asyncio.create_task(waiter())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

