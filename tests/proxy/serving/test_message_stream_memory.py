"""A translated /v1/messages stream holds no more than its current block (issue 39, item 11): a
long answer's text goes out piece by piece and is never gathered in memory (it was: 55 -> 177 MiB
for a 114 MiB stream, each piece copying the text so far)."""
from __future__ import annotations

import tracemalloc

from proxy.edge.anthropic import MessageStream

PIECE = "x" * 1024
PIECES = 4096   # 4 MiB of text


def test_a_long_translated_stream_does_not_gather_its_text() -> None:
    stream = MessageStream("m", "msg_long")
    sent = len(stream.start())
    tracemalloc.start()
    try:
        for _ in range(PIECES):
            sent += len(stream.feed({"choices": [{"delta": {"content": PIECE}}]}))
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent > PIECES * len(PIECE)   # every piece went out
    # What one piece's event takes, give or take, and nothing that grows with the answer.
    assert peak < 64 * 1024, peak
    assert stream.end().endswith(b'{"type": "message_stop"}\n\n')
