"""A remote provider as the `openai_remote` kind addresses it, without sending anything: its URL, the
Authorization header, the mapping of a request's body, and a provider's failure as a PoolError.

`Provider` is what both the request path (RemoteReach, proxy/lifecycle/kinds/remote.py) and the Files
API flow (remote_files.py) need, so neither imports the other. A user and password in
`remote_base_url` are taken out of the URL into a Secret of their own (Basic auth), so every URL the
kind shows is bare, and a provider's message loses any part of either and of the key.
"""
from __future__ import annotations

import base64
import email.utils
import json
import time
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import unquote, urlsplit

from proxy.errors import BackendError, PoolError, TooManyRequests
from proxy.lifecycle.kinds.remote_options import RemoteOptions, Secret
from proxy.masking import masked, shown_url
from proxy.upstream.reach import PROXY_ONLY_FIELDS

if TYPE_CHECKING:
    from proxy.config.model import ModelConfig


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


def userinfo(url: str) -> tuple[str, str] | None:
    """The user and password in `url` as written (percent-encoded); None without them."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if not parts.username and not parts.password:
        return None
    return parts.username or "", parts.password or ""


class Provider:
    """The provider of one model: its URL, the bearer key, and the body mapping. `options`: the
    model's, when the caller has read them already (RemoteOptions.from_config otherwise)."""

    def __init__(self, config: ModelConfig, key: Secret | None, options: RemoteOptions | None = None) -> None:
        opts = options if options is not None else RemoteOptions.from_config(config)
        self.model = config.name
        configured = str(opts.base_url).rstrip("/")
        # Sent without its userinfo, as Basic auth (what aiohttp would make of it), so no URL built
        # from base_url (requests, errors, health reasons, the admin view) can carry the password.
        self.base_url = shown_url(configured)
        self.served_model = str(opts.model)
        self.key = key
        found = userinfo(configured)
        self.basic = None if found is None else \
            Secret("Basic " + base64.b64encode(":".join(map(unquote, found)).encode()).decode("ascii"))
        # What a provider's message must not echo: the key, the user and password as written and decoded.
        shown = [key.reveal()] if key is not None else []
        shown += [*found, *map(unquote, found)] if found is not None else []
        self.secrets = tuple(Secret(v) for v in dict.fromkeys(shown) if v)
        # The options without base_url (it may hold the password, and this object's fields must not).
        self.key_env = opts.api_key_env
        self.timeout_s = opts.timeout_s
        self.max_retries = opts.max_retries
        self.thinking = opts.thinking
        self.cache_key = opts.prompt_cache_key_enabled
        self.file_mode = opts.file_mode
        self.file_purpose = opts.file_purpose

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
