"""systemd's readiness protocol (sd_notify(3)), in the few lines it takes: one datagram of
`KEY=value` lines to the unix socket named by $NOTIFY_SOCKET (an abstract one when the name
starts with `@`). Without the variable (not under a Type=notify unit) it does nothing.

The unit (conf/systemd/llm-pool.service) is Type=notify: `READY=1` once the proxy listens;
on a reload `RELOADING=1`, then `MAINPID=<successor>` with `READY=1` when the successor took over
(the main process changes: proxy/serving/reload.py), or `READY=1` alone when the reload failed
and nothing changed.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Mapping

log = logging.getLogger(__name__)
NOTIFY_SOCKET = "NOTIFY_SOCKET"
SEND_TIMEOUT_S = 1.0


def notify(*fields: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `fields` (each `KEY=value`) to the service manager; True when it was sent."""
    name = (os.environ if environ is None else environ).get(NOTIFY_SOCKET, "")
    if not name:
        return False
    if name[0] == "@":
        address = b"\0" + os.fsencode(name[1:])
    elif name[0] == "/":
        address = os.fsencode(name)
    else:
        log.warning("%s=%r: not a unix socket path (only those and @abstract names are supported); "
                    "systemd is not told %s", NOTIFY_SOCKET, name, ", ".join(fields))
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.sendto("\n".join(fields).encode(), address)
    except OSError as exc:
        log.warning("could not tell systemd %s on %s: %s", ", ".join(fields), name, exc)
        return False
    return True


def monotonic_usec() -> str:
    """The MONOTONIC_USEC field that must go with RELOADING=1 (systemd 253 and later)."""
    return f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
