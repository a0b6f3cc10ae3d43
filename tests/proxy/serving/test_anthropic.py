"""The Messages translation, checked against the Anthropic SDK's own reading of it: what the SDK
makes of a translated answer, a translated stream and an error is what a client of ours gets. The
SDK reads the bytes through its HTTP client's in-process transport (no server: this module does no I/O)."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2 as httpx   # the pinned SDK's HTTP client (httpx's successor)
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import BadRequest, PoolError, TooManyRequests, Unavailable
from proxy.serving.anthropic import (MessageStream, check_request, error_body, error_event, to_chat, to_message)

CHAT = [{"role": "user", "content": "hi"}]
PNG = "iVBORw0KGgo="


def sdk(status: int, body: bytes, content_type: str = "application/json",
        headers: dict[str, str] | None = None) -> anthropic.Anthropic:
    """The SDK, answered `body` for any request."""
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"Content-Type": content_type, **(headers or {})})
    return anthropic.Anthropic(api_key="unused", base_url="http://pool.invalid", max_retries=0,
                               http_client=httpx.Client(transport=httpx.MockTransport(answer)))


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": True}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": [None], "max_tokens": 4}, "messages.0"),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 4}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": []}], "max_tokens": 4}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use"}]}], "max_tokens": 4}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                             "media_type": "image/bmp",
                                                                             "data": PNG}}]}], "max_tokens": 4},
     "messages.0.content.0.source.media_type"),
    ({"messages": CHAT, "max_tokens": 4, "system": [{"type": "image"}]}, "system"),
    ({"messages": CHAT, "max_tokens": 4, "stop_sequences": "END"}, "stop_sequences"),
    ({"messages": CHAT, "max_tokens": 4, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT, "max_tokens": 4, "stream": "yes"}, "stream"),
    ({"messages": CHAT, "max_tokens": 4, "tools": [{"name": "t"}]}, "tools"),
])
def test_what_anthropic_would_refuse_is_refused_naming_where(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_request({"model": "m", **body})
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_request", param)


def test_a_request_becomes_a_chat_completion() -> None:
    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief"}],
            "temperature": 0.5, "top_k": 3, "stop_sequences": ["END"], "stream": True, "fairness_key": "ui",
            "metadata": {"user_id": "u"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": "c"},
                         {"role": "user", "content": [
                             {"type": "text", "text": "look"},
                             {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                             {"type": "image", "source": {"type": "url", "url": "https://example.com/x.png"}}]}]}
    check_request(body)
    assert to_chat(body) == {
        "model": "m", "max_tokens": 8, "temperature": 0.5, "top_k": 3, "stop": ["END"], "fairness_key": "ui",
        "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "Be\nbrief"}, {"role": "user", "content": "ab"},
                     {"role": "assistant", "content": "c"},
                     {"role": "user", "content": [
                         {"type": "text", "text": "look"},
                         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                         {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}]}]}


def test_a_chat_completion_is_the_message_the_sdk_reads() -> None:
    chat = {"choices": [{"message": {"content": "Hello"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    raw = json.dumps(to_message(chat, "m", "msg_1")).encode()
    message = sdk(200, raw).messages.create(model="m", max_tokens=2, messages=CHAT)  # type: ignore[arg-type]
    assert (message.id, message.model, message.content[0].text, message.stop_reason) == \
        ("msg_1", "m", "Hello", "max_tokens")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 2)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=12))
def test_whatever_a_replica_answers_reads_as_a_message_or_nothing(garbage: Any) -> None:
    chat = garbage if isinstance(garbage, dict) else {"choices": garbage, "usage": garbage}
    message = to_message(chat, "m", "msg_1")
    assert isinstance(message["content"][0]["text"], str) and message["stop_reason"] == "end_turn" or \
        message["stop_reason"] == "max_tokens"
    stream = MessageStream("m", "msg_1")
    stream.feed(chat)
    assert stream.end().endswith(b"event: message_stop\ndata: {\"type\": \"message_stop\"}\n\n")


def test_a_chat_stream_is_the_event_stream_the_sdk_reads() -> None:
    stream = MessageStream("m", "msg_2")
    chunks = [{"choices": [{"delta": {"role": "assistant"}}]},
              {"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]},
              {"choices": [{"delta": {}, "finish_reason": "stop"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}]
    events = stream.start() + b"".join(stream.feed(c) for c in chunks) + stream.end()
    assert stream.feed({"choices": [{"delta": {"content": ""}}]}) == b""   # no text, no event
    with sdk(200, events, "text/event-stream").messages.stream(model="m", max_tokens=2, messages=CHAT) as s:  # type: ignore[arg-type]
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert pieces == ["Hel", "lo"] and final.content[0].text == "Hello" == stream.text
    assert (final.id, final.stop_reason, final.usage.output_tokens) == ("msg_2", "end_turn", 2)


@pytest.mark.parametrize("err, exception, kind", [
    (BadRequest("no"), anthropic.BadRequestError, "invalid_request_error"),
    (TooManyRequests("full", retry_after=3), anthropic.RateLimitError, "rate_limit_error"),
    (Unavailable("loading", code="model_loading", retry_after=5), anthropic.InternalServerError, "overloaded_error"),
    (PoolError("bug"), anthropic.InternalServerError, "api_error"),
])
def test_the_pools_errors_are_the_sdks_exceptions(err: PoolError, exception: type[Exception], kind: str) -> None:
    client = sdk(err.status, json.dumps(error_body(err)).encode(), headers=err.headers())
    with pytest.raises(exception) as raised:
        client.messages.create(model="m", max_tokens=2, messages=CHAT)  # type: ignore[arg-type]
    assert raised.value.body == {"type": "error", "error": {"type": kind, "message": err.message}}  # type: ignore[attr-defined]


def test_a_stream_broken_off_ends_with_an_error_event_the_sdk_raises() -> None:
    stream = MessageStream("m", "msg_3")
    events = stream.start() + stream.feed({"choices": [{"delta": {"content": "Hi"}}]}) + \
        error_event(PoolError("the backend broke off the stream", status=502))
    with pytest.raises(anthropic.APIStatusError, match="broke off"):
        with sdk(200, events, "text/event-stream").messages.stream(model="m", max_tokens=2, messages=CHAT) as s:  # type: ignore[arg-type]
            list(s.text_stream)
