"""How a request reaches one replica: the data path's whole view of a replica's kind.

A replica carries a `Reach`; the data path sends to it without knowing whether it is a program on
this machine (`ProgramReach`, here) or a remote provider (proxy/lifecycle/kinds/remote.py).
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Protocol

import aiohttp

from launchers.spec import ProgramSpec
from proxy.upstream.client import Answer, UpstreamHttp

# Fields only llm-pool reads; a backend must never see them (the fairness key least of all).
# Every kind's reach strips them, so this is the one list.
PROXY_ONLY_FIELDS = ("fairness_key", "allow_remote")
# And what a server of ours never gets besides: the affinity key is the proxy's routing (a remote
# provider gets it where the model opts in, remote_prompt_cache_key_enabled), nor a client's `lora`:
# which adapter runs is the model id's (docs/adapters.md), never the client's to choose around it.
NOT_FOR_PROGRAMS = (*PROXY_ONLY_FIELDS, "prompt_cache_key", "lora")


class Reach(Protocol):
    """How a request gets to one replica."""

    served_model: str           # the `model` the replica expects
    engine_timings: bool        # its `timings` were measured by an engine we run (llama-server's own)

    def url(self, path: str) -> str: ...

    def post(self, http: UpstreamHttp, path: str, payload: dict[str, Any], request_id: str,
             timeout: aiohttp.ClientTimeout, raw: bytes | None = None,
             adapter: str | None = None) -> Awaitable[Answer]:
        """Send one OpenAI request (an `async def`, or a plain one that returns what to await). A
        refused or reset connection propagates (the replica died since it was picked); anything a
        kind handles itself becomes a PoolError. `raw`: the client's own bytes of `payload`, which a
        kind may send as they are where it would not change a thing. `adapter`: the LoRA adapter
        of the model that runs it (a kind that serves none is never given one)."""
        ...

    def describe(self) -> dict[str, object]: ...


class ProgramReach:
    """A replica that is a server process on this machine: plain HTTP to its port."""

    engine_timings = True

    def __init__(self, spec: ProgramSpec) -> None:
        self.base_url = spec.base_url
        self.served_model = spec.served_model
        self.headers = dict(spec.headers)   # e.g. vLLM's bearer key: sent, never logged
        # A backend's own bound on the wait for an answer's next bytes (vllm_serve_timeout_s).
        self.read_timeout_s = spec.request_timeout_s
        self.closes_after_streams = spec.closes_after_streams
        self.adapters = spec.adapters

    def url(self, path: str) -> str:
        return self.base_url + path

    def post(self, http: UpstreamHttp, path: str, payload: dict[str, Any], request_id: str,
             timeout: aiohttp.ClientTimeout, raw: bytes | None = None,
             adapter: str | None = None) -> Awaitable[Answer]:
        # A plain function that returns the client's request to await, not a coroutine that awaits it:
        # the request's task resumes through every coroutine layer around the send.
        adapters = self.adapters
        if raw is not None and adapter is None and payload.get("model") == self.served_model and \
                not any(k in payload for k in NOT_FOR_PROGRAMS):
            # Nothing to rewrite: the client's bytes go as they came, not decoded and encoded again.
            body = raw
        else:
            # As UTF-8, not \u escapes (6 bytes a character: up to 3 times the body, and its time); a
            # request's strings were checked at the edge (strict_json): no lone surrogate, all encode.
            chosen = adapters.fields(adapter) if adapters is not None and adapter is not None else {}
            body = json.dumps({**without_proxy_fields(payload, NOT_FOR_PROGRAMS), "model": self.served_model,
                               **chosen}, ensure_ascii=False).encode()
        if self.read_timeout_s is not None:
            timeout = aiohttp.ClientTimeout(total=timeout.total, sock_connect=timeout.sock_connect,
                                            sock_read=self.read_timeout_s)
        headers = {**self.headers, "Content-Type": "application/json", "X-Request-Id": request_id}
        if self.closes_after_streams and payload.get("stream"):
            # The pinned llama-server closes the connection after every streamed answer although
            # it answers Keep-Alive (measured), and a pool that reuses it fails the next request.
            # Asking for the close makes both ends agree, so a stream's connection never goes back
            # to the pool, and llama-server's HTTP thread is freed as the stream ends. A server
            # that keeps its connections (uvicorn, aiohttp: vLLM and the shims) keeps them: a new
            # connection per stream was a measurable share of the proxy's CPU per stream.
            headers["Connection"] = "close"
        return http.post(self.url(path), data=body, timeout=timeout, headers=headers)

    def describe(self) -> dict[str, object]:
        return {}


def without_proxy_fields(payload: dict[str, Any], fields: tuple[str, ...] = PROXY_ONLY_FIELDS) -> dict[str, Any]:
    if not any(k in payload for k in fields):
        return payload
    return {k: v for k, v in payload.items() if k not in fields}
