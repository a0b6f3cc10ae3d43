"""What the data path tells the pool about a replica, and the one thing it asks of one.

serving/ reports each request's outcome through `Outcomes` (the monitor implements it: health,
outlier ejection) and never holds the monitor itself; `process_gone` tells a replica that died
under a request from one that merely failed it, which decides whether the request fails over.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from proxy.lifecycle.state.replicas import Replica


class Outcomes(Protocol):
    """Where the data path reports what happened to a request on a replica."""

    def report_connection_failure(self, replica: Replica, error: str) -> None:
        """The replica refused or reset the connection, or its process is gone."""
        ...

    def report_outcome(self, replica: Replica, error: str | None = None) -> None:
        """A request ended on the replica: `error` says how it failed (a 5xx, a timeout), None if it did not."""
        ...


def process_gone(replica: Replica) -> bool:
    """Whether the process of a program replica has exited (gone, or a zombie supervisord has not
    reaped yet). False for an endpoint, or when its PID is not known yet."""
    if replica.spec is None or not replica.pid:
        return False
    try:
        os.kill(replica.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False   # alive, under another user
    try:
        stat = Path(f"/proc/{replica.pid}/stat").read_text()
    except OSError:
        return False   # no /proc: alive, as far as can be told
    return stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"])
