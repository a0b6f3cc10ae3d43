"""Reading a streamed chat answer the way the benchmarks time it: when its first content arrived,
its text, and the last usage and timings it carried (llama-server sends `timings` on its last chunk)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Streamed:
    first: float | None = None                     # perf_counter() at the first content
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)


async def read_stream(resp: aiohttp.ClientResponse) -> Streamed:
    out = Streamed()
    pieces = []
    async for line in resp.content:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                out.first = out.first or time.perf_counter()
                pieces.append(piece)
        out.usage = chunk.get("usage") or out.usage
        out.timings = chunk.get("timings") or out.timings
    out.text = "".join(pieces)
    return out
