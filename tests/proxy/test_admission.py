from __future__ import annotations

import asyncio

import pytest

from proxy.admission import FifoAdmission
from proxy.errors import Unavailable


async def test_requests_within_capacity_start_at_once() -> None:
    adm = FifoAdmission()
    adm.set_capacity(2)
    await adm.acquire()
    await adm.acquire()
    assert adm.active == 2 and adm.waiting == 0


async def test_waiters_are_served_in_arrival_order_as_slots_free() -> None:
    adm = FifoAdmission()
    adm.set_capacity(1)
    await adm.acquire()
    order: list[int] = []

    async def take(i: int) -> None:
        await adm.acquire()
        order.append(i)

    tasks = [asyncio.create_task(take(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert adm.waiting == 3
    for _ in range(3):
        adm.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]


async def test_capacity_growth_wakes_waiters() -> None:
    adm = FifoAdmission()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    adm.set_capacity(1)
    await waiter
    assert adm.active == 1


async def test_cancelled_waiter_leaves_the_queue() -> None:
    adm = FifoAdmission()
    adm.set_capacity(1)
    await adm.acquire()
    gone = asyncio.create_task(adm.acquire())
    nxt = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert adm.waiting == 1
    adm.release()
    await nxt
    assert adm.active == 1


async def test_slot_handed_to_a_cancelled_waiter_goes_to_the_next() -> None:
    adm = FifoAdmission()
    adm.set_capacity(1)
    await adm.acquire()
    first = asyncio.create_task(adm.acquire())
    second = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    adm.release()          # hands the slot to `first`...
    first.cancel()         # ...which is cancelled before it runs
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert adm.active == 1


async def test_close_fails_waiters_and_refuses_newcomers() -> None:
    adm = FifoAdmission()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    adm.close(Unavailable("unloading", code="model_unloading"))
    with pytest.raises(Unavailable):
        await waiter
    with pytest.raises(Unavailable):
        await adm.acquire()
