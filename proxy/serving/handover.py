"""A reload's handover, the successor's side: what a reloading `llm-pool serve` hands the process
it starts (proxy/serving/reload.py is the predecessor's side), and how that process takes over.

The predecessor passes open file descriptors, named in two variables (in the style of systemd's
LISTEN_FDS, with the numbers themselves since there are several kinds):

- `LLM_POOL_LISTEN_FDS=3,4`: its listening sockets. The successor serves on them instead of
  binding: the kernel's queue of connections is the same one, so no connection is ever refused.
- `LLM_POOL_HANDOVER=predecessor=PID,control=FD,lock=FD,stdout=FD,stderr=FD`: its PID; one end of a
  socket pair (the successor writes `ready`, the predecessor answers `go` or `abort`, and its end
  closes when it exits); the state folder's lock (an flock held by the open file both share, so the
  one-proxy-per-state-dir rule is handed over, never raced); and its own stdout and stderr (the
  journal), which the successor's output goes to once it took over (until then it goes through the
  predecessor, which keeps its last lines to say why a reload failed).

These come from the process environment (trusted), and are checked all the same: a variable left
in an environment by mistake must fail clearly, not serve on a stray descriptor.

Besides `go`, the predecessor sends its record on the control socket, one line each
(`<kind> <JSON>`): with `go`, its counters (`counters`, proxy/serving/carried.py), which the
successor goes on from; after that, each event it records while it drains (`event`); and as it exits,
its counters once more. The events journal (proxy/event_journal.py) passes with the service: the
predecessor writes it until `go`, the successor from then on.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import socket
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, MutableMapping

log = logging.getLogger(__name__)
LISTEN_FDS_ENV = "LLM_POOL_LISTEN_FDS"
HANDOVER_ENV = "LLM_POOL_HANDOVER"
HANDOVER_FIELDS = ("predecessor", "control", "lock", "stdout", "stderr")
READY, GO, ABORT = b"ready\n", b"go\n", b"abort\n"
COUNTERS, EVENT = "counters", "event"
# How long a successor waits for the counters that come with `go` (in the same write, so at once),
# in case its predecessor is a version that sends none.
COUNTERS_WAIT_S = 2.0
# The longest line on the control socket: a snapshot of the counters of many models and tenants.
MESSAGE_LIMIT = 64 * 1024 * 1024
# After the predecessor's end of the control socket closes, how long its exit may take to show
# (this process is handed to another parent): the fds close just before that, in the same exit.
REPARENT_WAIT_S = 10.0


def message(kind: str, body: Any) -> bytes:
    """One line of the predecessor's record for the successor."""
    return f"{kind} {json.dumps(body, separators=(',', ':'))}\n".encode()


def parse_message(line: bytes) -> tuple[str, Any] | None:
    kind, _, body = line.partition(b" ")
    try:
        return kind.decode("ascii"), json.loads(body)
    except ValueError:
        return None


class HandoverError(Exception):
    """The handover variables do not describe what a reloading proxy passes."""


@dataclass
class Inherited:
    """What a successor was handed. `listeners`: those not yet taken by a listener of its settings."""

    predecessor: int
    listeners: list[socket.socket]
    control: socket.socket
    lock_fd: int
    stdout_fd: int
    stderr_fd: int
    _taken: list[socket.socket] = field(default_factory=list)

    def take_listener(self, host: str, port: int) -> socket.socket | None:
        """The inherited socket that listens where (host, port) would: served as it is. None when
        the settings moved the listener (the successor binds the new address; the old one closes
        with the predecessor)."""
        wanted = _addresses(host, port)
        for sock in self.listeners:
            name = sock.getsockname()
            if (ipaddress.ip_address(name[0]), name[1]) in wanted:
                self.listeners.remove(sock)
                return sock
        return None

    def close_untaken(self) -> None:
        for sock in self.listeners:
            log.warning("handover: the predecessor's listener on %s is not in these settings; it closes with it",
                        _shown(sock))
            sock.close()
        self.listeners = []


def _addresses(host: str, port: int) -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return set()
    return {(ipaddress.ip_address(a[4][0]), int(a[4][1])) for a in found}


def _shown(sock: socket.socket) -> str:
    name = sock.getsockname()
    return f"{name[0]}:{name[1]}"


def handover_environ(environ: MutableMapping[str, str], listeners: list[int], predecessor: int, control: int,
                     lock: int, stdout: int, stderr: int) -> dict[str, str]:
    """The successor's environment: this one with the variables that hand it these descriptors."""
    fields = {"predecessor": predecessor, "control": control, "lock": lock, "stdout": stdout, "stderr": stderr}
    return {**environ, LISTEN_FDS_ENV: ",".join(str(fd) for fd in listeners),
            HANDOVER_ENV: ",".join(f"{k}={v}" for k, v in fields.items())}


def take_inherited(environ: MutableMapping[str, str]) -> Inherited | None:
    """What a reloading predecessor handed this process, or None when it was started otherwise.
    The variables are removed from `environ` (nothing this process starts sees them), and every
    descriptor is made non-inheritable (a supervisord this process starts must never hold the
    listening sockets: the port would outlive the proxy)."""
    listen = environ.pop(LISTEN_FDS_ENV, None)
    spec = environ.pop(HANDOVER_ENV, None)
    if listen is None and spec is None:
        return None
    if listen is None or spec is None:
        raise HandoverError(f"{LISTEN_FDS_ENV} and {HANDOVER_ENV} come together (a reloading llm-pool serve "
                            "sets both); unset the one that is left")
    try:
        fds = [int(fd) for fd in listen.split(",")]
        fields = {k: int(v) for k, v in (item.split("=", 1) for item in spec.split(","))}
    except ValueError:
        raise HandoverError(f"{LISTEN_FDS_ENV}={listen!r} or {HANDOVER_ENV}={spec!r}: not what a reloading "
                            "llm-pool serve sets") from None
    if sorted(fields) != sorted(HANDOVER_FIELDS) or not fds:
        raise HandoverError(f"{HANDOVER_ENV} must give {', '.join(HANDOVER_FIELDS)} and {LISTEN_FDS_ENV} at "
                            "least one descriptor")
    if fields["predecessor"] != os.getppid():
        raise HandoverError(f"{HANDOVER_ENV} names pid {fields['predecessor']}, which did not start this process "
                            f"(its parent is {os.getppid()}): left in an environment by mistake?")
    for fd in [*fds, *(fields[k] for k in HANDOVER_FIELDS[1:])]:
        try:
            os.fstat(fd)
        except OSError:
            raise HandoverError(f"descriptor {fd} named by {HANDOVER_ENV}/{LISTEN_FDS_ENV} is not open") from None
        os.set_inheritable(fd, False)
    listeners = []
    for fd in fds:
        sock = socket.socket(fileno=fd) if stat.S_ISSOCK(os.fstat(fd).st_mode) else None
        if sock is None or sock.type != socket.SOCK_STREAM or \
                not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise HandoverError(f"descriptor {fd} in {LISTEN_FDS_ENV} is not a listening TCP socket")
        listeners.append(sock)
    control = socket.socket(fileno=fields["control"]) if stat.S_ISSOCK(os.fstat(fields["control"]).st_mode) else None
    if control is None or control.family != socket.AF_UNIX:
        raise HandoverError(f"the control descriptor {fields['control']} is not a unix socket")
    if not stat.S_ISREG(os.fstat(fields["lock"]).st_mode):
        raise HandoverError(f"the lock descriptor {fields['lock']} is not a file")
    return Inherited(predecessor=fields["predecessor"], listeners=listeners, control=control,
                     lock_fd=fields["lock"], stdout_fd=fields["stdout"], stderr_fd=fields["stderr"])


class Succession:
    """The successor's side of the control socket: say it is ready, learn whether it took over,
    and notice when the predecessor has exited."""

    def __init__(self, inherited: Inherited) -> None:
        self.inherited = inherited
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        # The predecessor's counters as it handed over (proxy/serving/carried.py), once taken over.
        self.counters: Any = None

    async def take_over(self) -> bool:
        """Tell the predecessor this process accepts (its startup adoption is done) and wait for its
        answer: True on `go` (this process is the proxy now, and `counters` holds the predecessor's),
        False on `abort` or when the predecessor exited without answering (then it was never handed
        the service: it leaves the models as they are for whatever runs next)."""
        self._reader, self._writer = await asyncio.open_unix_connection(sock=self.inherited.control,
                                                                        limit=MESSAGE_LIMIT)
        self._writer.write(READY)
        try:
            await self._writer.drain()
            answer = await self._reader.readline()
        except (OSError, ValueError):
            answer = b""
        if answer == GO:
            self.counters = await self._counters()
            self._switch_output()   # the caller records (and so logs) the takeover
            return True
        log.error("reload: pid %d %s; exiting and leaving supervisord and the models as they are",
                  self.inherited.predecessor, "called the reload off" if answer == ABORT else
                  "exited before it handed over")
        return False

    async def _counters(self) -> Any:
        """The counters line that comes with `go` (in the same write), or None from a predecessor
        too old to send one (after COUNTERS_WAIT_S). After `go`, not before: a successor too old to
        read it then ignores it, where a line before `go` would make it exit with nobody serving."""
        assert self._reader is not None
        try:
            line = await asyncio.wait_for(self._reader.readline(), COUNTERS_WAIT_S)
        except (asyncio.TimeoutError, OSError, ValueError):   # ValueError: a line past MESSAGE_LIMIT
            # Taken over all the same: the counters start from zero, as they did before they were handed.
            log.warning("reload: pid %d sent no counters with `go`; the counters start from zero",
                        self.inherited.predecessor)
            return None
        parsed = parse_message(line)
        return parsed[1] if parsed is not None and parsed[0] == COUNTERS else None

    def _switch_output(self) -> None:
        """From now on write to the predecessor's stdout and stderr (the journal), not through it:
        it is about to exit."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.dup2(self.inherited.stdout_fd, 1)
        os.dup2(self.inherited.stderr_fd, 2)
        os.close(self.inherited.stdout_fd)
        os.close(self.inherited.stderr_fd)

    async def messages(self) -> AsyncIterator[tuple[str, Any]]:
        """What the predecessor sends after `go`, as (kind, JSON) pairs, until its end of the control
        socket closes (its process ends, whatever way it ends): the events it records while it
        drains, and its last counters."""
        assert self._reader is not None
        while True:
            try:
                line = await self._reader.readline()
            except ValueError:
                log.warning("reload: a message from pid %d was longer than %d bytes; dropped",
                            self.inherited.predecessor, MESSAGE_LIMIT)
                continue
            except OSError:
                return
            if not line:
                return
            parsed = parse_message(line)
            if parsed is not None:
                yield parsed

    async def predecessor_exited(self) -> None:
        """Return once the predecessor process has exited, after `messages` has ended: its end of
        the control socket is closed, and this process gets another parent (waitpid is no use for a
        process that is not a child)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPARENT_WAIT_S
        while os.getppid() == self.inherited.predecessor and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self._writer is not None:
            self._writer.close()
        log.info("reload: the predecessor (pid %d) has exited", self.inherited.predecessor)
