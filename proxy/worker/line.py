"""A worker's end of its channel to the controller (proxy/lease_wire.py)."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

from proxy.lease_wire import frame, read_frame

log = logging.getLogger(__name__)


class ControllerLine:
    """Sends what the worker tells; hands each frame from the controller to `on_frame`. `lost` is
    set when the channel ends: the controller is gone (or going), and the worker winds down."""

    def __init__(self, index: int, on_frame: Callable[[dict[str, Any], bytes], None]) -> None:
        self.index, self.on_frame = index, on_frame
        self.writer: asyncio.StreamWriter | None = None
        self.lost = asyncio.Event()
        self.reading: asyncio.Task[None] | None = None

    async def connect(self, path: str) -> None:
        reader, self.writer = await asyncio.open_unix_connection(path)
        self.tell({"t": "hello", "worker": self.index, "pid": os.getpid()})
        self.reading = asyncio.create_task(self._read(reader), name="controller channel")

    def tell(self, message: dict[str, Any], payload: bytes = b"") -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(frame(message, payload))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message, payload = await read_frame(reader)
                try:
                    self.on_frame(message, payload)
                except Exception:   # one bad frame costs its request, not the worker
                    log.exception("worker %d: a frame from the controller failed (%s)", self.index, message.get("t"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            log.exception("worker %d: the controller's channel broke", self.index)
        finally:
            self.lost.set()

    async def close(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
        if self.writer is not None:
            self.writer.close()
