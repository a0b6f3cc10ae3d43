"""The async admission around the fairness scheduler: futures, cancellation, capacity, closing."""
from __future__ import annotations

import asyncio

import pytest

from proxy.admission import Admission
from proxy.errors import TooManyRequests, Unavailable
from proxy.fairness import FairnessPolicy


async def test_requests_within_capacity_start_at_once() -> None:
    adm = Admission()
    adm.set_capacity(2)
    await adm.acquire("a")
    await adm.acquire("a")
    assert adm.active == 2 and adm.waiting == 0


async def test_waiters_of_one_key_are_served_in_arrival_order() -> None:
    adm = Admission()
    adm.set_capacity(1)
    first = await adm.acquire("k")
    order: list[int] = []

    async def take(i: int) -> object:
        ticket = await adm.acquire("k")
        order.append(i)
        return ticket

    tasks = [asyncio.create_task(take(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert adm.waiting == 3
    ticket = first
    for task in tasks:
        adm.release(ticket)
        ticket = await task
    assert order == [0, 1, 2]


async def test_capacity_growth_wakes_waiters() -> None:
    adm = Admission()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert not waiter.done()
    adm.set_capacity(1)
    await waiter
    assert adm.active == 1


async def test_cancelled_waiter_leaves_the_queue() -> None:
    adm = Admission()
    adm.set_capacity(1)
    held = await adm.acquire("a")
    gone = asyncio.create_task(adm.acquire("b"))
    nxt = asyncio.create_task(adm.acquire("c"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert adm.waiting == 1
    adm.release(held)
    await nxt
    assert adm.active == 1


async def test_slot_handed_to_a_cancelled_waiter_goes_to_the_next() -> None:
    adm = Admission()
    adm.set_capacity(1)
    held = await adm.acquire("a")
    first = asyncio.create_task(adm.acquire("b"))
    second = asyncio.create_task(adm.acquire("c"))
    await asyncio.sleep(0)
    adm.release(held)      # hands the slot to `first`...
    first.cancel()         # ...which is cancelled before it runs
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert adm.active == 1 and adm.waiting == 0


@pytest.mark.parametrize("turns", [0, 1])
async def test_a_waiter_cancelled_as_its_slot_is_granted_stays_cancelled(turns: int) -> None:
    # With a queue-wait bound (the shipped default), the grant and the client's cancel can land in
    # the same few loop turns; the cancel must win, or the handler of a client that has left goes
    # on to run its request upstream.
    adm = Admission(max_wait_s=60)
    adm.set_capacity(1)
    held = await adm.acquire("a")
    first = asyncio.create_task(adm.acquire("b"))
    second = asyncio.create_task(adm.acquire("c"))
    await asyncio.sleep(0)
    adm.release(held)
    for _ in range(turns):
        await asyncio.sleep(0)
    assert not first.done()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert adm.active == 1 and adm.waiting == 0


async def test_client_leaving_while_running_frees_the_slot() -> None:
    adm = Admission()
    adm.set_capacity(1)
    running = await adm.acquire("a")
    waiter = asyncio.create_task(adm.acquire("b"))
    await asyncio.sleep(0)
    adm.release(running, completed=False)
    await waiter
    assert adm.active == 1


async def test_full_queue_is_429_with_its_code_and_retry_after() -> None:
    adm = Admission(FairnessPolicy(max_pending_per_key=1, max_pending_per_executor=10))
    adm.set_capacity(1)
    await adm.acquire("a")
    queued = asyncio.create_task(adm.acquire("a"))
    await asyncio.sleep(0)
    with pytest.raises(TooManyRequests) as info:
        await adm.acquire("a")
    assert info.value.code == "fairness_key_queue_full" and info.value.status == 429
    assert int(info.value.headers()["Retry-After"]) >= 1
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)


async def test_close_fails_waiters_and_refuses_newcomers() -> None:
    adm = Admission()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    adm.close(Unavailable("unloading", code="model_unloading"))
    with pytest.raises(Unavailable):
        await waiter
    with pytest.raises(Unavailable):
        await adm.acquire()
    assert adm.waiting == 0


async def test_a_held_slot_is_released_by_its_timer_without_another_event() -> None:
    adm = Admission(FairnessPolicy(anticipation_ms=20))
    adm.set_capacity(1)
    ui = await adm.acquire("ui")
    batch = asyncio.create_task(adm.acquire("batch"))
    await asyncio.sleep(0)
    adm.release(ui)                     # held for ui, which does not come back
    assert not batch.done()
    await asyncio.wait_for(batch, timeout=10)  # the expiry timer hands the slot on
    assert adm.active == 1


async def test_a_waiter_past_max_wait_gets_queue_timeout_and_leaves_the_queue() -> None:
    adm = Admission(max_wait_s=0.01)
    adm.set_capacity(1)
    held = await adm.acquire("a")
    with pytest.raises(Unavailable) as info:
        await adm.acquire("b")
    assert info.value.code == "queue_timeout" and info.value.status == 503
    assert info.value.headers()["Retry-After"]
    assert adm.waiting == 0
    # The slot it waited for still goes to whoever comes next.
    nxt = asyncio.create_task(adm.acquire("c"))
    await asyncio.sleep(0)
    adm.release(held)
    await nxt
    assert adm.active == 1


async def test_hold_keeps_the_waiters_and_reopen_serves_them() -> None:
    adm = Admission()
    adm.set_capacity(1)
    running = await adm.acquire("a")
    waiter = asyncio.ensure_future(adm.acquire("b"))
    await asyncio.sleep(0)
    adm.hold()                      # the pool unloads the model to make room: b waits for its next load
    adm.release(running)
    await asyncio.sleep(0)
    assert not waiter.done() and adm.waiting == 1 and adm.active == 0
    adm.set_capacity(1)             # capacity from replicas is remembered, not applied while held
    adm.accept()                    # a new request for the model may queue: still held
    await asyncio.sleep(0)
    assert not waiter.done()
    adm.reopen()
    await asyncio.wait_for(waiter, 1)
    assert adm.active == 1


async def test_a_closed_queue_refuses_until_reopened() -> None:
    adm = Admission()
    adm.close(Unavailable("gone", code="model_unloading"))
    with pytest.raises(Unavailable):
        adm.enqueue("a")
    adm.reopen()
    adm.set_capacity(1)
    await adm.acquire("a")


async def test_a_wait_that_runs_out_while_the_model_cannot_load_says_why() -> None:
    adm = Admission(max_wait_s=0.01)
    adm.set_stall(Unavailable("no room", code="insufficient_memory", retry_after=5))
    with pytest.raises(Unavailable) as caught:
        await adm.acquire("a")
    assert caught.value.code == "insufficient_memory"
    adm.set_stall(None)
    with pytest.raises(Unavailable) as caught:
        await adm.acquire("a")
    assert caught.value.code == "queue_timeout"


async def test_hooks_tell_the_pool_a_request_waits_and_the_queue_is_idle() -> None:
    adm = Admission()
    events: list[str] = []
    adm.listen(on_queued=lambda: events.append("queued"), on_idle=lambda: events.append("idle"))
    adm.set_capacity(1)
    first = await adm.acquire("a")       # started at once: nothing to tell
    assert events == [] and adm.last_used > 0
    waiter = asyncio.ensure_future(adm.acquire("a"))
    await asyncio.sleep(0)
    assert events == ["queued"] and adm.oldest_wait_s() >= 0
    adm.release(first)
    second = await waiter
    assert events == ["queued"]          # the waiter took the slot: not idle
    adm.release(second)
    assert events == ["queued", "idle"] and adm.oldest_wait_s() == 0


def test_a_closed_queue_says_so_with_the_error_each_request_gets() -> None:
    adm = Admission()
    assert adm.describe() == {"open": True, "code": None, "reason": None}
    adm.close(Unavailable("model 'm' is being unloaded", code="model_unloading"))
    assert adm.describe() == {"open": False, "code": "model_unloading", "reason": "model 'm' is being unloaded"}
    adm.accept()
    assert adm.describe() == {"open": True, "code": None, "reason": None}
