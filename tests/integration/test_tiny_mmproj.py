"""The pinned llama-server on the demo model with the tiny projector (`llama_server_mmproj_path`,
`--mmproj`): a chat with an image is answered, on the OpenAI endpoint and on the Anthropic one, and
the image takes prompt tokens of its own."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from direct_llama_server import configured, served
from helpers import http, tiny_png
from launchers import llama_server

pytestmark = pytest.mark.integration

QUESTION = {"type": "text", "text": "what is in the picture?"}


PNG_B64 = base64.b64encode(tiny_png()).decode()


def chat(url: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    status, _, body = http("POST", url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": content}], "max_tokens": 4})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 4
    return body


def messages(url: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    status, _, body = http("POST", url + "/v1/messages",
                           {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content}]})
    assert status == 200, body
    assert body["type"] == "message" and body["usage"]["output_tokens"] <= 4
    return body


def test_the_demo_model_with_the_tiny_mmproj_answers_a_chat_with_an_image(
        tiny_gguf: Path, tiny_mmproj_gguf: Path, llama_server_bin: Path, tmp_path: Path) -> None:
    model = configured(tmp_path, model_path=str(tiny_gguf), llama_server_binary=str(llama_server_bin),
                       llama_server_mmproj_path=str(tiny_mmproj_gguf))
    assert "--mmproj" in llama_server.argv(model, "127.0.0.1", 1)
    with served(model, tmp_path / "llama-server.log") as url:
        image_url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_B64}}
        with_image = chat(url, [QUESTION, image_url])
        without = chat(url, [QUESTION])
        assert with_image["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]

        # llama-server's Anthropic endpoint takes Anthropic's image block. Its input_tokens leave
        # out the tokens read from the prompt cache, which the two requests share.
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
        def read(body: dict[str, Any]) -> int:
            usage = body["usage"]
            return int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens", 0))

        assert read(messages(url, [QUESTION, image])) > read(messages(url, [QUESTION]))


def test_without_the_mmproj_an_image_is_refused(tiny_gguf: Path, llama_server_bin: Path, tmp_path: Path) -> None:
    model = configured(tmp_path, model_path=str(tiny_gguf), llama_server_binary=str(llama_server_bin))
    with served(model, tmp_path / "llama-server.log") as url:
        image_url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG_B64}}
        status, _, body = http("POST", url + "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": [QUESTION, image_url]}], "max_tokens": 4})
    # The pinned build answers 500 (a server_error) for what is the request's fault.
    assert status == 500, body
    assert body["error"]["message"] == ("image input is not supported - hint: if this is unexpected, "
                                        "you may need to provide the mmproj"), body
