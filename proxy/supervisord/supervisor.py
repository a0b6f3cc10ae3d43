"""The supervisord driver: a small async XML-RPC client over a unix socket or HTTP.

XML-RPC bodies are built and parsed by the standard library; aiohttp carries them, so no call
blocks the event loop and every call has a timeout. Faults become typed exceptions. A transport
that breaks is thrown away and rebuilt on the next call, so a restarted supervisord is picked up.
"""
from __future__ import annotations

import asyncio
import base64
import enum
import xmlrpc.client
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from supervisor.xmlrpc import Faults

from proxy.masking import shown_url


class SupervisorError(Exception):
    """Any failure talking to supervisord."""


class SupervisorUnavailable(SupervisorError):
    """supervisord did not answer: not running, socket gone, or the call timed out."""


class SupervisorRefused(SupervisorUnavailable):
    """supervisord answered 401: the username or password is wrong."""


class SupervisorFault(SupervisorError):
    """supervisord answered with an XML-RPC fault."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{text} (fault {code})")
        self.code = code
        self.text = text


class BadName(SupervisorFault):
    pass


class AlreadyStarted(SupervisorFault):
    pass


class NotRunning(SupervisorFault):
    pass


class AlreadyAdded(SupervisorFault):
    pass


class StillRunning(SupervisorFault):
    pass


class SpawnError(SupervisorFault):
    pass


_FAULTS: dict[int, type[SupervisorFault]] = {
    Faults.BAD_NAME: BadName,
    Faults.ALREADY_STARTED: AlreadyStarted,
    Faults.NOT_RUNNING: NotRunning,
    Faults.ALREADY_ADDED: AlreadyAdded,
    Faults.STILL_RUNNING: StillRunning,
    Faults.SPAWN_ERROR: SpawnError,
}


class ProcessState(enum.IntEnum):
    """supervisord's process states (supervisor/states.py)."""

    STOPPED = 0
    STARTING = 10
    RUNNING = 20
    BACKOFF = 30
    STOPPING = 40
    EXITED = 100
    FATAL = 200
    UNKNOWN = 1000


@dataclass(frozen=True)
class ProcessInfo:
    group: str
    name: str
    state: ProcessState
    pid: int
    exitstatus: int
    description: str
    spawnerr: str = ""   # why supervisord could not start it, or "Exited too quickly ..."

    @property
    def fullname(self) -> str:
        return f"{self.group}:{self.name}"

    @classmethod
    def from_rpc(cls, info: dict[str, Any]) -> "ProcessInfo":
        try:
            state = ProcessState(info["state"])
        except ValueError:
            state = ProcessState.UNKNOWN
        return cls(group=info["group"], name=info["name"], state=state, pid=int(info["pid"]),
                   exitstatus=int(info["exitstatus"]), description=info.get("description", ""),
                   spawnerr=str(info.get("spawnerr") or ""))


class SupervisorClient:
    """Async access to one supervisord's XML-RPC interface.

    `url` is `unix:///path/to/supervisor.sock` or `http://host:port` (the `/RPC2` path is added).
    """

    def __init__(self, url: str, timeout: float = 10.0, auth: tuple[str, str] | None = None) -> None:
        self.url = url
        self.timeout = timeout
        # A node's username and password (inet_http_server): sent with each call, never logged.
        self._headers = {"Content-Type": "text/xml"}
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode("ascii")
            self._headers["Authorization"] = f"Basic {token}"   # what supervisord's http server checks
        self._session: aiohttp.ClientSession | None = None
        # Calls in flight per session. A failed call retires its session (the next call builds a
        # fresh transport) but the session closes only once its last call has ended: closing it at
        # once broke every other call in flight on it, so one call's timeout (a slow getFootprint)
        # failed the monitor's getProcesses beside it, and a node that answered was marked down.
        self._users: dict[aiohttp.ClientSession, int] = {}
        parts = urlsplit(url)
        if parts.scheme == "unix":
            self._socket: str | None = parts.path
            self._endpoint = "http://supervisord/RPC2"
        elif parts.scheme in ("http", "https"):
            self._socket = None
            path = parts.path if parts.path not in ("", "/") else "/RPC2"
            self._endpoint = f"{parts.scheme}://{parts.netloc}{path}"
        else:
            raise ValueError(f"supervisor url must be unix:// or http(s)://, not {url!r}")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.UnixConnector(path=self._socket) if self._socket else aiohttp.TCPConnector()
            self._session = aiohttp.ClientSession(connector=connector,
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def _drop_transport(self) -> None:
        session, self._session = self._session, None
        if session is not None and not self._users.get(session):
            await session.close()

    async def call(self, method: str, *params: Any) -> Any:
        body = xmlrpc.client.dumps(params, methodname=method, allow_none=False)
        session = self._client()
        self._users[session] = self._users.get(session, 0) + 1
        try:
            async with session.post(self._endpoint, data=body.encode(), headers=self._headers) as resp:
                payload = await resp.read()
                if resp.status == 401:
                    raise SupervisorRefused(f"supervisord at {shown_url(self.url)} refused the username and password "
                                            f"({method})")
                if resp.status != 200:
                    raise SupervisorError(f"{method}: HTTP {resp.status} from supervisord")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if self._session is session:
                self._session = None
            raise SupervisorUnavailable(f"supervisord at {shown_url(self.url)} did not answer {method}: "
                                        f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._users[session] -= 1
            if not self._users[session]:
                del self._users[session]
                if session is not self._session:
                    await session.close()   # retired, and its last call has ended
        try:
            (result,), _ = xmlrpc.client.loads(payload)
        except xmlrpc.client.Fault as fault:
            raise _FAULTS.get(fault.faultCode, SupervisorFault)(fault.faultCode, fault.faultString) from None
        return result

    async def close(self) -> None:
        await self._drop_transport()

    # The surface the pool uses; names follow supervisord's API.

    async def ping(self) -> bool:
        try:
            return await self.call("supervisor.getState") is not None
        except SupervisorUnavailable:
            return False

    async def get_pid(self) -> int:
        return int(await self.call("supervisor.getPID"))

    async def all_process_info(self) -> list[ProcessInfo]:
        return [ProcessInfo.from_rpc(i) for i in await self.call("supervisor.getAllProcessInfo")]

    async def process_info(self, fullname: str) -> ProcessInfo:
        return ProcessInfo.from_rpc(await self.call("supervisor.getProcessInfo", fullname))

    async def reload_config(self) -> tuple[list[str], list[str], list[str]]:
        """Re-read the configuration; returns the (added, changed, removed) group names."""
        [[added, changed, removed]] = await self.call("supervisor.reloadConfig")
        return added, changed, removed

    async def add_process_group(self, name: str) -> None:
        await self.call("supervisor.addProcessGroup", name)

    async def remove_process_group(self, name: str) -> None:
        await self.call("supervisor.removeProcessGroup", name)

    async def start_process(self, fullname: str) -> None:
        # wait=False: readiness is the health check's business, not supervisord's startsecs.
        await self.call("supervisor.startProcess", fullname, False)

    async def stop_process(self, fullname: str) -> None:
        await self.call("supervisor.stopProcess", fullname, False)

    async def tail_log(self, fullname: str, length: int = 4000) -> str:
        text, _offset, _overflow = await self.call("supervisor.tailProcessStdoutLog", fullname, 0, length)
        return str(text)

    async def tail_log_end(self, fullname: str, length: int) -> tuple[str, int]:
        """The last `length` bytes of the program's log (stdout and stderr) and the log's size."""
        text, size, _overflow = await self.call("supervisor.tailProcessStdoutLog", fullname, 0, length)
        return str(text), int(size)

    async def read_log(self, fullname: str, offset: int, length: int) -> str:
        """`length` bytes of the program's log from `offset` on."""
        return str(await self.call("supervisor.readProcessStdoutLog", fullname, offset, length))

    async def main_log_tail(self, length: int) -> str:
        """The last `length` bytes of supervisord's own log (its readLog): what it did to each
        process and why, such as `exited: NAME (terminated by SIGKILL; not expected)`."""
        return str(await self.call("supervisor.readLog", -length, 0))

    async def shutdown(self) -> None:
        await self.call("supervisor.shutdown")
