"""Which image URLs a request may pass to a model server (an image-capable server fetches them itself).

`data:` URLs are always allowed. Other schemes only where the model's `image_url_schemes` lists
them (default: data only), and even then the host must resolve to public addresses only:
loopback, private, link-local (cloud metadata at 169.254.169.254 among them), shared, reserved,
multicast and unspecified addresses are refused unless the model sets `image_url_allow_private`.
Host names are resolved for the check; a server that resolves them again later could be answered
differently (DNS rebinding), so a model that must never reach inside should keep `data` only.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any, Iterator
from urllib.parse import urlsplit

from proxy.config.model import ModelConfig
from proxy.errors import BadRequest

DEFAULT_SCHEMES = ("data",)
RESOLVE_TIMEOUT_S = 5.0
CODE = "image_url_not_allowed"


def image_urls(messages: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """(param, url) of each image item in OpenAI chat `messages` (or one content value)."""
    items = messages if isinstance(messages, list) else []
    for i, message in enumerate(items):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, item in enumerate(content):
            if not isinstance(item, dict) or item.get("type") not in ("image_url", "input_image"):
                continue
            value = item.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if isinstance(url, str):
                yield f"{prefix}.{i}.content.{j}.image_url", url


def request_image_urls(body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Image URLs anywhere a chat completion or a /v1/responses request carries them."""
    yield from image_urls(body.get("messages"), "messages")
    if isinstance(body.get("input"), list):
        yield from image_urls([{"content": body["input"]}], "input")


async def check_image_urls(body: dict[str, Any], model: ModelConfig) -> None:
    """Raise 400 `image_url_not_allowed`, naming the rule, for the first URL the model may not get.

    It walks the parsed body, never its bytes: a scan of the bytes for `image` could read them
    otherwise than the parser did (JSON escapes, UTF-16), and on a large body it cost more than this
    walk of messages and content items (0.14 s for 32 MiB; the walk ~1 us)."""
    for param, url in request_image_urls(body):
        await check_url(url, model, param)


async def check_url(url: str, model: ModelConfig, param: str) -> None:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return
    allowed = tuple(model.get("image_url_schemes", DEFAULT_SCHEMES))
    if scheme not in allowed or scheme not in ("http", "https"):
        raise BadRequest(f"image URL scheme {scheme or '(none)'!r} is not allowed for model {model.name!r} "
                         f"(image_url_schemes: {list(allowed)}; data: is always allowed)", code=CODE, param=param)
    if model.get("image_url_allow_private", False):
        return
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host:
        raise BadRequest(f"image URL {url[:100]!r} has no host", code=CODE, param=param)
    for address in await _addresses(host, port or (443 if scheme == "https" else 80), param):
        reason = _private(address)
        if reason:
            raise BadRequest(f"image URL host {host!r} is {reason} address {address}; model {model.name!r} "
                             "allows only public addresses (image_url_allow_private: false)", code=CODE, param=param)


async def _addresses(host: str, port: int, param: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host.strip("[]").split("%", 1)[0])]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError, UnicodeError):
        raise BadRequest(f"image URL host {host!r} does not resolve; it cannot be checked against the "
                         "address rules (image_url_allow_private: false)", code=CODE, param=param) from None
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def _private(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `address` is not public, or None."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    for test, name in ((address.is_unspecified, "an unspecified"), (address.is_loopback, "a loopback"),
                       (address.is_link_local, "a link-local (metadata)"), (address.is_private, "a private"),
                       (address.is_multicast, "a multicast"), (address.is_reserved, "a reserved"),
                       (not address.is_global, "a non-public")):
        if test:
            return name
    return None
