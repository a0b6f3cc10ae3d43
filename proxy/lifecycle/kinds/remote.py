"""The `openai_remote` kind: a replica that is an OpenAI-compatible Chat Completions endpoint.

Nothing runs on this machine: starting reads the API key from the environment and, if asked, checks
that the provider lists the model; stopping forgets the endpoint. A request needs the caller's
`allow_remote: true` (remote calls may cost money), is mapped to the provider's request (model
name, thinking field, cache key opt-in, files), and is retried only before any byte of the answer
exists. The key lives in one `Secret` whose text is masked, so no repr, log line or error can show it;
a user and password in `remote_base_url` are taken out of the URL into a Secret of their own (Basic
auth), so every URL the kind shows is bare, and a provider's message loses any part of either.

Here: the sending (RemoteReach) and the runner (EndpointKind). The fields as read are RemoteOptions
(remote_options.py); the URL, key, body mapping and errors are Provider (provider.py), which the Files
API flow (remote_files.py) shares; the config checks and the gate are EndpointRules (rules.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import aiohttp

from proxy.errors import BackendError, PoolError
from proxy.lifecycle.kinds import remote_files
from proxy.lifecycle.kinds.provider import Provider, retry_after_s
from proxy.lifecycle.kinds.remote_options import RemoteOptions
from proxy.lifecycle.kinds.rules import EndpointRules
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.upstream.client import Answer, UpstreamHttp
from proxy.upstream.connection import MalformedAnswer

if TYPE_CHECKING:
    from proxy.config.model import ModelConfig
    from proxy.lifecycle.state.runtime import ModelRuntime

log = logging.getLogger(__name__)

RETRY_BACKOFF_S = 0.2   # first wait after a failure without Retry-After; doubles per attempt


class RemoteReach(Provider):
    """How a request reaches the provider (the `Reach` of an endpoint replica): the provider's URL,
    key and body mapping (`Provider`), and the sending, with its retries."""

    engine_timings = False   # a provider's own timing fields are not GPU times we measured

    async def post(self, http: UpstreamHttp, path: str, payload: dict[str, Any], request_id: str,
                   timeout: aiohttp.ClientTimeout, raw: bytes | None = None, adapter: str | None = None) -> Answer:
        """Map, resolve files, send; retry connection errors, 429 and 5xx within remote_timeout_s.
        (`raw` is not used: a provider's request always differs from the client's, in `model` at least;
        nor `adapter`: a provider's model serves none, check-config says.)

        The caller's timeout is for local programs; a provider gets remote_timeout_s for a whole
        answer, or for each chunk of a stream. Only a success is returned; a provider's error
        becomes a PoolError (its body, which could echo the key, is never relayed as is). Nothing
        has reached the client before this returns, so every retry happens before the first byte.
        """
        body = self.map_body(payload)
        stream = bool(body.get("stream"))
        if self.file_mode == "files_extract":
            async with remote_files.extracted(http, self, body) as body:
                return await self._send(http, path, body, stream)
        return await self._send(http, path, body, stream)

    async def _send(self, http: UpstreamHttp, path: str, body: dict[str, Any],
                    stream: bool) -> Answer:
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(self.max_retries + 1):
            left = deadline - time.monotonic()
            timeout = aiohttp.ClientTimeout(total=None if stream else left, sock_read=self.timeout_s,
                                            sock_connect=min(left, 10.0))
            wait = RETRY_BACKOFF_S * 2 ** attempt
            try:
                resp = await http.post(self.url(path), data=data, headers=self.headers(), timeout=timeout)
            except asyncio.TimeoutError as exc:
                raise BackendError(f"remote provider of {self.model!r} did not answer within remote_timeout_s "
                                   f"({self.timeout_s:g}s)", code="remote_timeout", status=504) from exc
            except MalformedAnswer as exc:
                # The provider answered, with bytes that are no answer: sending again would not help.
                raise BackendError(f"remote provider of {self.model!r} {exc}") from exc
            except aiohttp.ClientError as exc:
                failure: PoolError = BackendError(f"remote provider of {self.model!r} at {self.base_url} could "
                                                  f"not be reached: {why_unreachable(exc)}")
            else:
                if 200 <= resp.status < 300:
                    return resp
                if resp.status != 429 and resp.status < 500:
                    raise self.error(resp.status, await _read_and_close(resp), resp.headers, "the request")
                failure = self.error(resp.status, await _read_and_close(resp), resp.headers, "the request")
                asked = retry_after_s(resp.headers)
                wait = wait if asked is None else asked
            if attempt == self.max_retries or time.monotonic() + wait >= deadline:
                raise failure
            log.info("remote %s: %s; retry %d of %d in %.1fs", self.model, failure.message, attempt + 1,
                     self.max_retries, wait)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")


def why_unreachable(exc: aiohttp.ClientError) -> str:
    """A connection failure in words ("connection refused (ClientConnectorError)"): aiohttp's own
    text says "Connect call failed" whatever the reason, and the class name says less."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, OSError):
        words = os.strerror(os_error.errno) if os_error.errno and os_error.errno > 0 else os_error.strerror
        if words:
            return f"{words[0].lower()}{words[1:]} ({type(exc).__name__})"
    return type(exc).__name__


async def _read_and_close(resp: Answer) -> bytes:
    try:
        return await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return b""
    finally:
        resp.release()


class EndpointKind(EndpointRules):
    """`openai_remote` models: one endpoint replica per configured replica, no program (the runner;
    its rules are EndpointRules, proxy/lifecycle/kinds/rules.py)."""

    def __init__(self, http: UpstreamHttp | None, environ: Mapping[str, str]) -> None:
        # http None: the provider is never called (tests of the rules); a start needs the session.
        super().__init__(environ)
        self.http = http

    def _reach(self, config: ModelConfig) -> tuple[RemoteReach, RemoteOptions]:
        opts = RemoteOptions.from_config(config)
        return RemoteReach(config, opts.key(self.environ), opts), opts

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        reach, opts = self._reach(config)
        runtime.replicas = [Replica(model=config.name, index=i, reach=reach) for i in range(config.replicas)]
        for replica in runtime.replicas:
            runtime.set_replica_state(replica, ReplicaState.STARTING)
        problem = await self._health(reach) if opts.health_check == "models" else None
        for replica in runtime.replicas:
            runtime.set_replica_state(replica, ReplicaState.FAILED if problem else ReplicaState.READY, problem)

    async def _health(self, reach: RemoteReach) -> str | None:
        """remote_health_check: models: GET {base}/models once and find remote_model in it."""
        url = reach.url("/v1/models")
        assert self.http is not None, "a remote model's health check needs the proxy's HTTP session"
        try:
            async with self.http.get(url, headers=reach.headers(json_body=False),
                                     timeout=aiohttp.ClientTimeout(total=reach.timeout_s)) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return reach.error(resp.status, raw, resp.headers, f"GET {url}").message
            ids = {m.get("id") for m in json.loads(raw).get("data", []) if isinstance(m, dict)}
        except asyncio.TimeoutError:
            return f"GET {url} got no answer within remote_timeout_s ({reach.timeout_s:g}s)"
        except aiohttp.ClientError as exc:
            return f"GET {url} failed: {why_unreachable(exc)}"
        except (ValueError, AttributeError):
            return f"GET {url} did not answer with an OpenAI model list"
        if reach.served_model not in ids:
            listed = sorted(map(str, ids))[:20]
            return f"remote_model {reach.served_model!r} is not among the models {url} lists: {listed}"
        return None

    async def stop(self, runtime: ModelRuntime) -> None:
        return None   # nothing runs here; requests in flight were drained or cancelled by the pool

    async def add(self, runtime: ModelRuntime, config: ModelConfig, indices: Sequence[int]) -> list[Replica]:
        """Scaling an endpoint model changes how many requests the proxy sends it at once (each
        replica is target_inflight more); the provider is not asked again, it was judged at load."""
        reach, _ = self._reach(config)
        added = [Replica(model=config.name, index=i, reach=reach) for i in indices]
        runtime.replicas = sorted(runtime.replicas + added, key=lambda r: r.index)
        for replica in added:
            runtime.set_replica_state(replica, ReplicaState.STARTING)
            runtime.set_replica_state(replica, ReplicaState.READY)
        return added

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        return None   # nothing runs for them
