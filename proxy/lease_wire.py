"""The channel between the controller and its workers (proxy/serving/leases.py, proxy/worker/): one
Unix stream connection per worker, carrying frames both ways. A frame is two lengths (4 bytes each,
big-endian), a compact JSON object (its `t` says what it is), and that many bytes of payload (a
request's or an answer's body, as they are: never encoded into the JSON).

What each side sends (docs/workers.md):
- worker: `hello` (its index and pid) once; per lease `head` (the replica's status and headers),
  then `body` (a whole non-streamed answer) or `end` (how its relayed stream went), or `failed`
  (the send did not reach a live server); `stats` when asked.
- controller: `lease` (where to send the request, with what, and the body), `abort` (the
  controller gave up on it: a timeout, its client left), `ask` (for stats).
"""
from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

LENGTHS = struct.Struct(">II")
# A frame's JSON is a few hundred bytes; its payload is a request or answer body, bounded by the
# service's own limits where it was read. These only keep a corrupt length from allocating gigabytes.
MAX_JSON = 1 << 20
MAX_PAYLOAD = 1 << 31

# Headers between a worker and its controller's socket (proxy/serving/leases.py): a request a worker
# passes on says which of its requests it is ("<worker>:<ref>"), and the controller's answer to one
# whose stream the worker relayed itself says so. Honoured only on the controller's own socket.
LEASE_HEADER = "X-LLM-Pool-Lease"
RELAYED_HEADER = "X-LLM-Pool-Relayed"
PEER_HEADER = "X-LLM-Pool-Peer"   # the client's address, as the worker saw it


# One encoder for every frame: json.dumps with any argument builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


class WireError(Exception):
    """A frame that breaks the framing: the channel is closed."""


def frame(message: dict[str, Any], payload: bytes = b"") -> bytes:
    head = _encode(message).encode()
    return LENGTHS.pack(len(head), len(payload)) + head + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """The next frame; asyncio.IncompleteReadError at the channel's end."""
    size, length = LENGTHS.unpack(await reader.readexactly(LENGTHS.size))
    if size > MAX_JSON or length > MAX_PAYLOAD:
        raise WireError(f"a frame of {size} + {length} bytes")
    message = json.loads(await reader.readexactly(size))
    if not isinstance(message, dict) or not isinstance(message.get("t"), str):
        raise WireError("a frame without its kind")
    return message, (await reader.readexactly(length) if length else b"")
