"""A stream that ended is a success with its counts, whatever the client does next (issue 39, item 9):
an SDK that closes just after `data: [DONE]` while the proxy still waits for the backend's end of
the answer (a cancelled handler: was 499 with 0 tokens), or before the proxy's last write (was a
500 from write_eof's ClientConnectionResetError). Against the FAKE provider (tests/fakes.py), which
holds its connection open after [DONE] here, with the tenants' real ledger."""
from __future__ import annotations

import asyncio
from pathlib import Path

from metered import HANG_GUARD, Metered, metered_pool
from proxy.serving.keys import METRICS

WORDS = 5


async def read_to_done_and_close(metered: Metered) -> None:
    async with metered.client.post(metered.url + "/v1/chat/completions", json=metered.chat("hi"),
                                   headers=metered.headers()) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.strip() == b"data: [DONE]":
                resp.close()   # as the OpenAI SDK does once it has read [DONE]
                return
    raise AssertionError("no [DONE]")


def statuses(metered: Metered) -> list[str]:
    """The request metrics' status labels (what the traffic view and the page's Err/s read)."""
    counter = metered.requests[-1].app[METRICS].requests
    return [s.labels["status"] for m in counter.collect() for s in m.samples
            if s.name.endswith("_total") and s.value]


async def test_a_client_that_closes_after_done_while_the_handler_waits_is_a_success(tmp_path: Path) -> None:
    async with metered_pool(tmp_path) as metered:
        metered.provider.script("gpt-fake", "linger")   # [DONE], then the answer stays open
        await read_to_done_and_close(metered)
        await metered.until_finished(1)   # its handler was cancelled: the client hung up
        row = metered.ledger()
        assert (row["requests"], row["errors"], row["output_tokens"]) == (1, 0, WORDS)
        assert metered.seen[-1][2] is False   # the provider's own usage, which the proxy asked for
        assert statuses(metered) == ["200"]   # not "cancelled"


async def test_a_client_that_closes_before_the_last_write_is_a_success(tmp_path: Path) -> None:
    # Without handler cancellation the proxy finds the client gone only when it writes the stream's end.
    async with metered_pool(tmp_path, handler_cancellation=False) as metered:
        metered.provider.script("gpt-fake", "linger")
        await read_to_done_and_close(metered)
        transport = metered.requests[-1].transport
        async with asyncio.timeout(HANG_GUARD.total):   # a hang guard: until the proxy saw the close
            while transport is not None and not transport.is_closing():
                await asyncio.sleep(0.01)
        metered.provider.release()   # the provider ends the answer; the proxy ends its stream
        await metered.until_finished(1)
        row = metered.ledger()
        assert (row["requests"], row["errors"], row["output_tokens"]) == (1, 0, WORDS)
        assert statuses(metered) == ["200"]   # not 500 from write_eof
