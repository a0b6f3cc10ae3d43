"""Image URL policy: data always, other schemes per model, never private addresses unless allowed."""
from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.config.model import ModelConfig
from proxy.errors import BadRequest
from proxy.serving.image_urls import check_image_urls


def model(**options: Any) -> ModelConfig:
    return ModelConfig(name="vision", backend="llama_server", enabled=True, replicas=1, replica_max=1,
                       target_inflight=1, modalities=("text", "image"), gpus=(), options=options)


def chat(url: str) -> dict[str, Any]:
    return {"model": "vision", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                     {"type": "image_url", "image_url": {"url": url}}]}]}


async def refused(body: dict[str, Any], config: ModelConfig) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        await check_image_urls(body, config)
    assert info.value.code == "image_url_not_allowed" and info.value.status == 400
    return info.value


async def test_data_urls_are_always_allowed() -> None:
    await check_image_urls(chat("data:image/png;base64,iVBORw0KGgo="), model())


@pytest.mark.parametrize("url", ["http://127.0.0.1:8011/x.png", "https://example.com/cat.png",
                                 "file:///etc/passwd", "ftp://example.com/a.png", "relative.png"])
async def test_by_default_only_data_urls_pass(url: str) -> None:
    err = await refused(chat(url), model())
    assert "image_url_schemes: ['data']" in err.message
    assert err.param == "messages.1.content.1.image_url"


@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.1:8011/x.png", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("https://10.1.2.3/a.png", "private"),
    ("http://[::1]:80/a.png", "loopback"),
    ("http://[::ffff:192.168.0.1]/a.png", "private"),
    ("http://0.0.0.0/a.png", "unspecified"),
    ("http://localhost:9/a.png", "loopback"),   # resolved: localhost is loopback
])
async def test_allowed_schemes_still_never_reach_private_addresses(url: str, reason: str) -> None:
    err = await refused(chat(url), model(image_url_schemes=["data", "http", "https"]))
    assert reason in err.message and "image_url_allow_private" in err.message


async def test_public_addresses_pass_where_the_scheme_is_allowed() -> None:
    await check_image_urls(chat("https://93.184.215.14/cat.png"), model(image_url_schemes=["https"]))


async def test_file_urls_are_refused_even_when_private_addresses_are_allowed() -> None:
    await refused(chat("file:///etc/passwd"), model(image_url_schemes=["data", "http"], image_url_allow_private=True))


async def test_allow_private_lets_a_local_image_server_through() -> None:
    await check_image_urls(chat("http://127.0.0.1:8000/x.png"),
                           model(image_url_schemes=["http"], image_url_allow_private=True))


async def test_responses_input_items_are_checked_too() -> None:
    body = {"model": "vision", "input": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]}
    err = await refused(body, model(image_url_schemes=["http"]))
    assert err.param == "input.0.content.0.image_url"


async def test_an_image_item_spelled_with_json_escapes_is_checked() -> None:
    # `\u0069mage_url` decodes to image_url, though its bytes do not say "image": the check reads
    # the parsed body, not the bytes.
    raw = (b'{"model": "vision", "messages": [{"role": "user", "content": [{"type": "\\u0069mage_url", '
           b'"\\u0069mage_url": {"url": "http://169.254.169.254/latest"}}]}]}')
    assert b"image" not in raw
    await refused(json.loads(raw), model())


async def test_a_body_without_images_passes() -> None:
    await check_image_urls({"model": "vision", "messages": [{"role": "user", "content": "hi"}]}, model())
