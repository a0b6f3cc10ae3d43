"""The `openai_remote` kind: a replica that is an OpenAI-compatible Chat Completions endpoint.

Nothing runs on this machine: starting reads the API key from the environment and, if asked, checks
that the provider lists the model; stopping forgets the endpoint. A request needs the caller's
`allow_remote: true` (remote calls may cost money), is mapped to the provider's request (model
name, thinking field, cache key opt-in, files), and is retried only before any byte of the answer
exists. The key lives in one `Secret` whose text is masked, so no repr, log line or error can show it;
a user and password in `remote_base_url` are taken out of the URL into a Secret of their own (Basic
auth), so every URL the kind shows is bare, and a provider's message loses any part of either.
"""
from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence
from urllib.parse import unquote, urlsplit

import aiohttp

from proxy.lifecycle.kinds import remote_files
from proxy.capabilities import Traits
from proxy.errors import BackendError, Forbidden, PoolError, TooManyRequests
from proxy.upstream.reach import PROXY_ONLY_FIELDS
from proxy.masking import MASK, masked, shown_url
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.upstream.client import Answer, UpstreamHttp
from proxy.upstream.connection import MalformedAnswer

if TYPE_CHECKING:
    from proxy.config.model import ModelConfig
    from proxy.lifecycle.state.runtime import ModelRuntime

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
# Fields only llm-pool reads; a provider never sees them.
RETRY_BACKOFF_S = 0.2   # first wait after a failure without Retry-After; doubles per attempt


# What a remote provider can do (proxy/capabilities.py reads it): chat with multi-turn messages, the
# provider's own thinking switch, the seed's decoding mapping (temperature, top_p, max_tokens and
# stop), and file items where `remote_file_mode` says how.
TRAITS = Traits(multi_turn=True, thinking="provider", decoding_only=("max_tokens", "temperature", "top_p"),
                file_inputs_field="remote_file_mode", model_field="remote_model")


class Secret:
    """A value that never shows itself: str() and repr() are masked."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        """`text` with the value, and any part of it of MIN_PART characters or more, masked."""
        return masked(text, (self._value,))

    def __repr__(self) -> str:
        return f"Secret({MASK})"

    __str__ = __repr__


def allowed(headers: Mapping[str, str], body: Mapping[str, Any]) -> bool:
    """`allow_remote: true` in the body; plain OpenAI clients may send X-Allow-Remote: true instead."""
    flag = body.get("allow_remote")
    if flag is None:
        return headers.get("X-Allow-Remote", "").strip().lower() == "true"
    return flag is True


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """Retry-After as seconds: a number, or an HTTP date."""
    value = headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class RemoteReach:
    """How a request reaches the provider: its URL, the bearer key, and the body mapping."""

    engine_timings = False   # a provider's own timing fields are not GPU times we measured

    def __init__(self, config: ModelConfig, key: Secret | None) -> None:
        self.model = config.name
        configured = str(config.get("remote_base_url")).rstrip("/")
        # Sent without its userinfo, as Basic auth (what aiohttp would make of it), so no URL built
        # from base_url (requests, errors, health reasons, the admin view) can carry the password.
        self.base_url = shown_url(configured)
        self.served_model = str(config.get("remote_model"))
        self.key = key
        found = userinfo(configured)
        self.basic = None if found is None else \
            Secret("Basic " + base64.b64encode(":".join(map(unquote, found)).encode()).decode("ascii"))
        # What a provider's message must not echo: the key, the user and password as written and decoded.
        shown = [key.reveal()] if key is not None else []
        shown += [*found, *map(unquote, found)] if found is not None else []
        self.secrets = tuple(Secret(v) for v in dict.fromkeys(shown) if v)
        self.key_env = config.get("remote_api_key_env")
        self.timeout_s = float(config.get("remote_timeout_s", DEFAULT_TIMEOUT_S))
        self.max_retries = int(config.get("remote_max_retries", 0))
        self.thinking = config.get("remote_thinking")
        self.cache_key = bool(config.get("remote_prompt_cache_key_enabled", False))
        self.file_mode = config.get("remote_file_mode")
        self.file_purpose = config.get("remote_file_purpose")

    def url(self, path: str) -> str:
        # The base URL ends in the API version (https://api.moonshot.ai/v1), like the OpenAI client's.
        return self.base_url + (path[3:] if path.startswith("/v1/") else path)

    def headers(self, json_body: bool = True) -> dict[str, str]:
        out = {"Content-Type": "application/json"} if json_body else {}
        if self.key is not None:
            out["Authorization"] = f"Bearer {self.key.reveal()}"
        elif self.basic is not None:
            out["Authorization"] = self.basic.reveal()
        return out

    def describe(self) -> dict[str, object]:
        return {"endpoint": self.base_url}

    def map_body(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """The provider's request: its model name, its thinking field, and the cache key only where
        this model opted in."""
        out = {k: v for k, v in payload.items() if k not in PROXY_ONLY_FIELDS}
        if not self.cache_key:
            out.pop("prompt_cache_key", None)
        out["model"] = self.served_model
        if self.thinking in ("enabled", "disabled") and "thinking" not in out:
            # Moonshot's documented shape (platform.kimi.ai, Chat Completions: `thinking`), which
            # Zhipu's GLM uses too; a request's own `thinking` wins.
            out["thinking"] = {"type": self.thinking}
        return out

    def error(self, status: int, raw: bytes, headers: Mapping[str, str], what: str) -> PoolError:
        """A provider's failure as the client should see it."""
        try:
            message = str(json.loads(raw)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:500] or f"HTTP {status}"
        message = masked(message, (s.reveal() for s in self.secrets))
        if status == 429:
            wait = retry_after_s(headers)
            return TooManyRequests(f"remote provider of {self.model!r} is rate limiting {what}: {message}",
                                   code="remote_rate_limited", retry_after=1.0 if wait is None else wait)
        if status in (401, 403):
            # The client is not at fault: the configured key (or user and password) is.
            refused = f"the API key from ${self.key_env}" if self.key_env else \
                "the user and password in remote_base_url" if self.basic is not None else "a call without a key"
            return BackendError(f"remote provider of {self.model!r} refused {refused} (HTTP {status}) on {what}",
                                code="remote_auth_failed")
        if status >= 500:
            return BackendError(f"remote provider of {self.model!r} failed {what}: {message}")
        return BackendError(f"remote provider of {self.model!r} rejected {what}: {message}",
                            code="backend_error", status=status)

    async def post(self, http: UpstreamHttp, path: str, payload: dict[str, Any], request_id: str,
                   timeout: aiohttp.ClientTimeout, raw: bytes | None = None) -> Answer:
        """Map, resolve files, send; retry connection errors, 429 and 5xx within remote_timeout_s.
        (`raw` is not used: a provider's request always differs from the client's, in `model` at least.)

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


def userinfo(url: str) -> tuple[str, str] | None:
    """The user and password in `url` as written (percent-encoded); None without them."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if not parts.username and not parts.password:
        return None
    return parts.username or "", parts.password or ""


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


class EndpointKind:
    """`openai_remote` models: one endpoint replica per configured replica, no program."""

    def __init__(self, http: UpstreamHttp | None, environ: Mapping[str, str]) -> None:
        # http None: for checks only (check-config); a start needs the session.
        self.http = http
        self.environ = environ

    def _key(self, config: ModelConfig) -> Secret | None:
        env = config.get("remote_api_key_env")
        return Secret(self.environ[env]) if env and self.environ.get(env) else None

    def check(self, config: ModelConfig) -> list[str]:
        env = config.get("remote_api_key_env")
        if env and not self.environ.get(env):
            return [f"engine.models.{config.name}.remote_api_key_env: environment variable {env} is not set "
                    "(or empty) in the proxy's environment"]
        if env and userinfo(str(config.get("remote_base_url"))) is not None:
            # A request carries one Authorization header: the key's Bearer or the URL's Basic.
            return [f"engine.models.{config.name}.remote_base_url: holds a user and password, and "
                    "remote_api_key_env names a key too; keep one of the two"]
        return []

    async def start(self, runtime: ModelRuntime, config: ModelConfig) -> None:
        reach = RemoteReach(config, self._key(config))
        runtime.replicas = [Replica(model=config.name, index=i, reach=reach) for i in range(config.replicas)]
        for replica in runtime.replicas:
            runtime.set_replica_state(replica, ReplicaState.STARTING)
        problem = await self._health(config, reach) if config.get("remote_health_check") == "models" else None
        for replica in runtime.replicas:
            runtime.set_replica_state(replica, ReplicaState.FAILED if problem else ReplicaState.READY, problem)

    async def _health(self, config: ModelConfig, reach: RemoteReach) -> str | None:
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
        reach = RemoteReach(config, self._key(config))
        added = [Replica(model=config.name, index=i, reach=reach) for i in indices]
        runtime.replicas = sorted(runtime.replicas + added, key=lambda r: r.index)
        for replica in added:
            runtime.set_replica_state(replica, ReplicaState.STARTING)
            runtime.set_replica_state(replica, ReplicaState.READY)
        return added

    async def remove(self, runtime: ModelRuntime, replicas: list[Replica]) -> None:
        return None   # nothing runs for them

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        if not allowed(headers, body):
            raise Forbidden(f"model {config.name!r} is served by a remote provider and calls to it may cost "
                            "money: send `allow_remote: true` in the body (or the header X-Allow-Remote: true)",
                            code="remote_not_allowed", param="allow_remote")

    def describe(self, config: ModelConfig) -> dict[str, object]:
        env = config.get("remote_api_key_env")
        return {"remote": {"base_url": shown_url(str(config.get("remote_base_url"))),
                           "model": config.get("remote_model"),
                           "api_key_env": env, "api_key_set": bool(env and self.environ.get(env)),
                           "health_check": config.get("remote_health_check", "config_only"),
                           "file_mode": config.get("remote_file_mode")}}
