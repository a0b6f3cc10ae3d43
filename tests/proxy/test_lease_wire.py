"""The controller's and workers' frames (proxy/lease_wire.py): what goes in comes out, body bytes
as they are, and a frame that breaks the framing is refused, not allocated."""
from __future__ import annotations

import asyncio

import pytest

from proxy.lease_wire import LENGTHS, MAX_JSON, WireError, frame, read_frame


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_frames_come_out_as_they_went_in_with_their_bytes_untouched() -> None:
    body = b'{"model": "m"}\n\x00\xff' * 3
    reader = reader_of(frame({"t": "lease", "lease": 7, "url": "http://127.0.0.1:1/v1/chat"}, body) +
                       frame({"t": "abort", "lease": 7}))
    assert await read_frame(reader) == ({"t": "lease", "lease": 7, "url": "http://127.0.0.1:1/v1/chat"}, body)
    assert await read_frame(reader) == ({"t": "abort", "lease": 7}, b"")
    with pytest.raises(asyncio.IncompleteReadError):   # the channel's end
        await read_frame(reader)


@pytest.mark.parametrize("data", [
    LENGTHS.pack(MAX_JSON + 1, 0),                      # a length no frame has
    LENGTHS.pack(2, 0) + b"[]",                         # JSON, but not an object
    LENGTHS.pack(8, 0) + b'{"x": 1}',                   # an object without its kind
])
async def test_a_frame_that_breaks_the_framing_is_refused(data: bytes) -> None:
    with pytest.raises(WireError):
        await read_frame(reader_of(data))
