"""Kinds of replica: what differs between a supervised program and a remote endpoint.

The pool's decisions (admission, routing, states, metrics) are the same for every model; what a
kind decides is how its replicas start and stop, whether they are healthy, how a request reaches
one (URL, headers, body) and which gate a request to it must pass. `Kind` is that seam; `Reach` is
what a replica carries so that the data path can send to it without knowing what it is.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import aiohttp

from launchers import launcher_for
from launchers.spec import ProgramSpec
from proxy.lifecycle.remote import EndpointKind

if TYPE_CHECKING:
    from proxy.config import ModelConfig
    from proxy.lifecycle.programs import Programs
    from proxy.lifecycle.replicas import Replica
    from proxy.lifecycle.runtime import ModelRuntime


# Backends whose replica is a remote endpoint; every other runnable backend has a launcher.
ENDPOINT_BACKENDS = frozenset({"openai_remote"})


class Reach(Protocol):
    """How a request gets to one replica."""

    served_model: str           # the `model` the replica expects
    engine_timings: bool        # its `timings` were measured by an engine we run (llama-server's own)

    def url(self, path: str) -> str: ...

    async def post(self, http: aiohttp.ClientSession, path: str, payload: dict[str, Any], request_id: str,
                   timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """Send one OpenAI request. A refused or reset connection propagates (the replica died since
        it was picked); anything a kind handles itself becomes a PoolError."""
        ...

    def describe(self) -> dict[str, object]: ...


class Kind(Protocol):
    """Start, stop and gate one kind of replica; the pool calls nothing else that differs per kind."""

    def check(self, config: ModelConfig) -> list[str]:
        """Problems that stop the model from loading, each naming the field (never a secret's value)."""
        ...

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        """Create runtime.replicas and set them going; health decides READY (the pool waits for it)."""
        ...

    async def stop(self, runtime: ModelRuntime) -> None:
        """Whatever runs for the replicas is gone when this returns."""
        ...

    async def add(self, runtime: ModelRuntime, config: ModelConfig, indices: range) -> list[Replica]:
        """Live scaling up: append replicas `indices` to runtime.replicas and set them going, leaving
        the others alone; health decides READY (the pool waits for it). Returns the new replicas."""
        ...

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        """Live scaling down: whatever runs for `replicas` (already drained) is gone when this
        returns; the others are left alone."""
        ...

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        """Raise a PoolError if this request may not go to such a model at all."""
        ...

    def describe(self, config: ModelConfig) -> dict[str, object]:
        """Extra fields of the model's admin row."""
        ...


class ProgramReach:
    """A replica that is a server process on this machine: plain HTTP to its port."""

    engine_timings = True

    def __init__(self, spec: ProgramSpec) -> None:
        self.base_url = spec.base_url
        self.served_model = spec.served_model
        self.headers = dict(spec.headers)   # e.g. vLLM's bearer key: sent, never logged
        # A backend's own bound on the wait for an answer's next bytes (vllm_serve_timeout_s).
        self.read_timeout_s = spec.request_timeout_s

    def url(self, path: str) -> str:
        return self.base_url + path

    async def post(self, http: aiohttp.ClientSession, path: str, payload: dict[str, Any], request_id: str,
                   timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        body = json.dumps({**payload, "model": self.served_model}).encode()
        if self.read_timeout_s is not None:
            timeout = aiohttp.ClientTimeout(total=timeout.total, sock_connect=timeout.sock_connect,
                                            sock_read=self.read_timeout_s)
        headers = {**self.headers, "Content-Type": "application/json", "X-Request-Id": request_id}
        if payload.get("stream"):
            # The pinned llama-server closes the connection after every streamed answer although
            # it answers Keep-Alive (measured), and a pool that reuses it fails the next request.
            # Asking for the close makes both ends agree (llama-server, uvicorn and aiohttp answer
            # Connection: close), so a stream's connection never goes back to the pool. A new
            # loopback connection per stream costs next to nothing, and frees llama-server's HTTP
            # thread as the stream ends.
            headers["Connection"] = "close"
        return await http.post(self.url(path), data=body, timeout=timeout, headers=headers)

    def describe(self) -> dict[str, object]:
        return {}


class ProgramKind:
    """Replicas as supervisord programs, written by the backend's launcher (proxy/programs.py)."""

    def __init__(self, programs: Programs | None) -> None:
        self.programs = programs   # None: for checks only (check-config)

    def check(self, config: ModelConfig) -> list[str]:
        launcher = launcher_for(config.backend)
        assert launcher is not None
        return launcher.check(config)

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        assert self.programs is not None
        await self.programs.start(runtime, config, launcher_for(config.backend))

    async def stop(self, runtime: ModelRuntime) -> None:
        assert self.programs is not None
        await self.programs.stop(runtime.name)

    async def add(self, runtime: ModelRuntime, config: ModelConfig, indices: range) -> list[Replica]:
        assert self.programs is not None
        return await self.programs.add(runtime, config, launcher_for(config.backend), indices)

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        assert self.programs is not None
        await self.programs.remove([r.spec.program for r in replicas if r.spec is not None])

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        return None

    def describe(self, config: ModelConfig) -> dict[str, object]:
        return {}


def kinds_for(backends: set[str], environ: Mapping[str, str], programs: Programs | None = None,
              http: aiohttp.ClientSession | None = None) -> dict[str, Kind]:
    """The kind of each configured backend this version can run; a backend left out answers
    409 backend_not_supported on load. Without programs and a session they can only `check`."""
    program = ProgramKind(programs)
    endpoint = EndpointKind(http, environ)  # type: ignore[arg-type]
    kinds: dict[str, Kind] = {}
    for backend in backends:
        if backend in ENDPOINT_BACKENDS:
            kinds[backend] = endpoint
        elif launcher_for(backend) is not None:
            kinds[backend] = program
    return kinds
