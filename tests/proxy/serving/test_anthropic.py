"""The Messages translation, checked against the Anthropic SDK's own reading of it: what the SDK
makes of a translated answer, a translated stream and an error is what a client of ours gets. The
SDK reads the bytes through its HTTP client's in-process transport (no server: this module does no I/O).
Beside it, the check's rules one by one, and properties over generated requests and streams."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2 as httpx   # the pinned SDK's HTTP client (httpx's successor)
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import BadRequest, PoolError, TooManyRequests, Unavailable
from proxy.edge.anthropic import (MessageStream, check_request, error_body, error_event, to_chat, to_message)

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
    ({"messages": CHAT, "max_tokens": 4, "tools": [{"name": "t"}]}, "tools.0.input_schema"),
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
    assert pieces == ["Hel", "lo"] and final.content[0].text == "Hello"
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


# -- the check: more of what Anthropic refuses, and what it takes -------------------------------

def image(source: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image", "source": source}]}


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 4}, "messages"),
    ({"messages": {"role": "user", "content": "hi"}, "max_tokens": 4}, "messages"),
    ({"messages": [{"content": "hi"}], "max_tokens": 4}, "messages.0.role"),
    ({"messages": [*CHAT, {"role": "tool", "content": "x"}], "max_tokens": 4}, "messages.1.role"),
    ({"messages": [{"role": "user", "content": 7}], "max_tokens": 4}, "messages.0.content"),
    ({"messages": [{"role": "user"}], "max_tokens": 4}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": ["hi"]}], "max_tokens": 4}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}], "max_tokens": 4},
     "messages.0.content.1"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}], "max_tokens": 4},
     "messages.0.content.0.text"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}], "max_tokens": 4}, "messages.0.content.0"),
    ({"messages": [image(None)], "max_tokens": 4}, "messages.0.content.0.source"),
    ({"messages": [image({"type": "file", "file_id": "f"})], "max_tokens": 4}, "messages.0.content.0.source"),
    ({"messages": [image({"type": "base64", "media_type": "image/png", "data": 1})], "max_tokens": 4},
     "messages.0.content.0.source.data"),
    ({"messages": [image({"type": "base64", "data": PNG})], "max_tokens": 4},
     "messages.0.content.0.source.media_type"),
    ({"messages": [image({"type": "url"})], "max_tokens": 4}, "messages.0.content.0.source.url"),
    ({"messages": CHAT, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": "8"}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": -3}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 4, "system": 3}, "system"),
    ({"messages": CHAT, "max_tokens": 4, "system": [{"type": "text", "text": None}]}, "system"),
    ({"messages": CHAT, "max_tokens": 4, "system": ["be brief"]}, "system"),
    ({"messages": CHAT, "max_tokens": 4, "stop_sequences": ["END", 1]}, "stop_sequences"),
    ({"messages": CHAT, "max_tokens": 4, "temperature": True}, "temperature"),
    ({"messages": CHAT, "max_tokens": 4, "top_p": "0.9"}, "top_p"),
    ({"messages": CHAT, "max_tokens": 4, "top_k": 1.5}, "top_k"),
    ({"messages": CHAT, "max_tokens": 4, "top_k": False}, "top_k"),
    ({"messages": CHAT, "max_tokens": 4, "stream": 1}, "stream"),
])
def test_more_that_anthropic_refuses_is_refused_naming_where(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_request({"model": "m", **body})
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "invalid_request", param)
    assert f"`{param}`" in refused.value.message   # the message names the field as the param does


def test_an_unsupported_block_is_named_with_the_types_that_are_supported() -> None:
    with pytest.raises(BadRequest) as refused:
        check_request({"max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "42"}}]}]})
    assert "'document'" in refused.value.message and "text, image, tool_use" in refused.value.message


def test_the_messages_say_what_the_field_must_be() -> None:
    def message(**fields: Any) -> str:
        with pytest.raises(BadRequest) as refused:
            check_request({"max_tokens": 4, "messages": CHAT, **fields})
        return refused.value.message
    assert "integer" in message(top_k=0.5) and "number" in message(top_p="x")
    assert "image/png, image/jpeg, image/gif, image/webp" in message(
        messages=[image({"type": "base64", "media_type": "image/tiff", "data": PNG})])
    assert "JSON schema of type object" in message(tools=[{"name": "search", "input_schema": {}}])
    assert "server tools run at Anthropic" in message(tools=[{"type": "web_search_20250305", "name": "web_search"}])


@pytest.mark.parametrize("extra", [
    {}, {"tools": []}, {"tools": None}, {"system": "be brief"}, {"system": []}, {"stream": False},
    {"stop_sequences": []}, {"temperature": 0}, {"temperature": 1.0}, {"top_p": 1}, {"top_k": 40},
    {"metadata": {"user_id": "u"}, "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}},
    {"messages": [image({"type": "url", "url": "https://example.com/a.gif"})]},
    {"messages": [image({"type": "base64", "media_type": "image/webp", "data": PNG}), {"role": "assistant",
                                                                                      "content": "a"}]},
])
def test_what_anthropic_takes_passes(extra: dict[str, Any]) -> None:
    check_request({"model": "m", "max_tokens": 1, "messages": CHAT, **extra})


# -- the request: chat's body -------------------------------------------------------------------

def test_the_fields_chat_has_no_use_for_are_dropped_and_off_is_left_out() -> None:
    body = {"model": "m", "max_tokens": 3, "messages": CHAT, "system": "", "stream": False, "stop_sequences": [],
            "metadata": {"user_id": "u"}, "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"},
            "tools": [], "top_p": 0.9}
    check_request(body)
    assert to_chat(body) == {"model": "m", "max_tokens": 3, "top_p": 0.9, "messages": [{"role": "user",
                                                                                        "content": "hi"}]}


def test_a_system_string_is_the_first_message_and_the_request_is_left_as_it_was() -> None:
    body = {"model": "m", "max_tokens": 3, "system": "Be brief", "stop_sequences": ["a", "b"],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    before = json.loads(json.dumps(body))
    chat = to_chat(body)
    assert chat["messages"] == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "x"}]
    chat["stop"].append("c")
    assert body == before   # the chat body shares no list with the request


TEXT = st.text(max_size=12)
BLOCK = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, TEXT),
    st.builds(lambda m, d: {"type": "image", "source": {"type": "base64", "media_type": m, "data": d}},
              st.sampled_from(["image/png", "image/jpeg", "image/gif", "image/webp"]), TEXT),
    st.builds(lambda u: {"type": "image", "source": {"type": "url", "url": u}}, TEXT))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                 "content": TEXT | st.lists(BLOCK, min_size=1, max_size=4)})
REQUEST = st.fixed_dictionaries(
    {"model": st.just("m"), "max_tokens": st.integers(1, 10**6), "messages": st.lists(MESSAGE, min_size=1, max_size=4)},
    optional={"system": TEXT | st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXT), max_size=3),
              "temperature": st.floats(0, 1), "top_p": st.floats(0, 1), "top_k": st.integers(0, 100),
              "stop_sequences": st.lists(TEXT, max_size=3), "stream": st.booleans(), "fairness_key": TEXT})


@given(REQUEST)
def test_every_well_formed_request_passes_and_keeps_its_turns_in_order(body: dict[str, Any]) -> None:
    check_request(body)
    chat = to_chat(body)
    assert json.loads(json.dumps(chat)) == chat
    turns = chat["messages"][1:] if chat["messages"][0]["role"] == "system" else chat["messages"]
    assert [t["role"] for t in turns] == [m["role"] for m in body["messages"]]
    for turn, message in zip(turns, body["messages"]):
        blocks = message["content"] if isinstance(message["content"], list) else [
            {"type": "text", "text": message["content"]}]
        if all(b["type"] == "text" for b in blocks):
            assert turn["content"] == "".join(b["text"] for b in blocks)   # text-only engines take a string
        else:
            assert [p["type"] for p in turn["content"]] == [
                "text" if b["type"] == "text" else "image_url" for b in blocks]
    assert chat["max_tokens"] == body["max_tokens"] and chat.get("fairness_key") == body.get("fairness_key")
    assert ("stream_options" in chat) == bool(body.get("stream")) == chat.get("stream", False)


# -- the answer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("finish, reason", [
    ("stop", "end_turn"), ("length", "max_tokens"), (None, "end_turn"), ("tool_calls", "tool_use"),
    ("content_filter", "end_turn"), (3, "end_turn"), (["length"], "end_turn")])
def test_a_finish_reason_is_a_stop_reason(finish: Any, reason: str) -> None:
    message = to_message({"choices": [{"message": {"content": "x"}, "finish_reason": finish}]}, "m", "msg")
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, None)


@pytest.mark.parametrize("chat", [
    {}, {"choices": []}, {"choices": [None]}, {"choices": [{"message": None}]},
    {"choices": [{"message": {"content": None}}]}, {"choices": [{"message": {"content": ["x"]}}]},
    {"choices": "x", "usage": {"prompt_tokens": True, "completion_tokens": -4}},
    {"usage": {"prompt_tokens": "7", "completion_tokens": 2.5}}, [], None])
def test_a_malformed_answer_reads_as_an_empty_message(chat: Any) -> None:
    assert to_message(chat, "m", "msg_9") == {
        "id": "msg_9", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": ""}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0}}


# -- the stream ---------------------------------------------------------------------------------

def events_of(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """SSE bytes as (event, data) pairs, each block exactly `event: ...\\ndata: ...`."""
    assert raw.endswith(b"\n\n")
    pairs = []
    for block in raw.decode().split("\n\n")[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        pairs.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return pairs


def test_each_event_carries_its_type_in_its_data_in_anthropics_order() -> None:
    stream = MessageStream("m", "msg_4")
    raw = stream.start() + stream.feed({"choices": [{"delta": {"content": "a"}}]}) + \
        stream.feed({"choices": [{"delta": {}, "finish_reason": "length"}]}) + \
        stream.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}) + stream.end()
    events = events_of(raw)
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert (start["id"], start["model"], start["content"], start["usage"]) == \
        ("msg_4", "m", [], {"input_tokens": 0, "output_tokens": 0})
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[2][1] == {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}}
    assert events[4][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert (stream.input_tokens, stream.output_tokens) == (9, 1)


def test_the_sdk_reads_the_raw_events_and_the_prompts_count_from_the_end() -> None:
    stream = MessageStream("m", "msg_5")
    raw = stream.start() + stream.feed({"choices": [{"delta": {"content": "Hi"}, "finish_reason": "length"}],
                                        "usage": {"prompt_tokens": 11, "completion_tokens": 1}}) + stream.end()
    client = sdk(200, raw, "text/event-stream")
    kinds = [event.type for event in client.messages.create(model="m", max_tokens=1, messages=CHAT,  # type: ignore[arg-type]
                                                             stream=True)]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    with client.messages.stream(model="m", max_tokens=1, messages=CHAT) as s:  # type: ignore[arg-type]
        final = s.get_final_message()
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("max_tokens", 11, 1)


def test_a_stream_without_text_is_an_empty_message_to_the_sdk() -> None:
    stream = MessageStream("m", "msg_6")
    assert stream.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}) == b""
    assert stream.feed([1, 2]) == b""  # type: ignore[arg-type]  # untrusted: not even an object
    with sdk(200, stream.start() + stream.end(), "text/event-stream").messages.stream(
            model="m", max_tokens=1, messages=CHAT) as s:  # type: ignore[arg-type]
        final = s.get_final_message()
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [("text", "")]
    assert (final.stop_reason, final.usage.input_tokens) == ("end_turn", 3)


@given(st.lists(st.text(), max_size=8))
def test_the_sdk_reads_back_exactly_the_text_that_was_streamed(pieces: list[str]) -> None:
    stream = MessageStream("m", "msg_7")
    raw = stream.start() + b"".join(stream.feed({"choices": [{"delta": {"content": p}}]}) for p in pieces)
    raw += stream.end()
    assert raw.count(b"event: content_block_delta") == sum(1 for p in pieces if p)
    with sdk(200, raw, "text/event-stream").messages.stream(model="m", max_tokens=1, messages=CHAT) as s:  # type: ignore[arg-type]
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == "".join(pieces)  # type: ignore[union-attr]


# -- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("status, kind, exception", [
    (400, "invalid_request_error", anthropic.BadRequestError),
    (401, "authentication_error", anthropic.AuthenticationError),
    (403, "permission_error", anthropic.PermissionDeniedError),
    (404, "not_found_error", anthropic.NotFoundError),
    (409, "invalid_request_error", anthropic.ConflictError),
    (413, "request_too_large", anthropic.ContentTooLargeError),
    (415, "invalid_request_error", anthropic.APIStatusError),
    (422, "invalid_request_error", anthropic.UnprocessableEntityError),
    (429, "rate_limit_error", anthropic.RateLimitError),
    (500, "api_error", anthropic.InternalServerError),
    (502, "api_error", anthropic.InternalServerError),
    (503, "overloaded_error", anthropic.ServiceUnavailableError),
    (504, "api_error", anthropic.GatewayTimeoutError),
    (529, "overloaded_error", anthropic.OverloadedError),
])
def test_every_status_has_the_type_and_the_sdk_exception_anthropic_gives_it(
        status: int, kind: str, exception: type[anthropic.APIStatusError]) -> None:
    err = PoolError("why", status=status)
    assert error_body(err) == {"type": "error", "error": {"type": kind, "message": "why"}}
    with pytest.raises(exception) as raised:
        sdk(status, json.dumps(error_body(err)).encode()).messages.create(
            model="m", max_tokens=2, messages=CHAT)  # type: ignore[arg-type]
    assert raised.value.status_code == status and raised.value.body == error_body(err)


def test_an_error_event_is_one_sse_event_in_anthropics_shape() -> None:
    err = TooManyRequests("queue is full")
    assert events_of(error_event(err)) == [
        ("error", {"type": "error", "error": {"type": "rate_limit_error", "message": "queue is full"}})]
    stream = MessageStream("m", "msg_8")
    with pytest.raises(anthropic.APIStatusError) as raised:
        with sdk(200, stream.start() + error_event(err), "text/event-stream").messages.stream(
                model="m", max_tokens=2, messages=CHAT) as s:  # type: ignore[arg-type]
            s.get_final_message()
    assert raised.value.body == error_body(err)


# -- tools ----------------------------------------------------------------------------------------

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
         "content": [{"type": "text", "text": "no station"},
                     {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]},
        {"type": "text", "text": "Thanks"}]}]


@pytest.mark.parametrize("extra", [
    {"tools": [WEATHER]}, {"tools": [{**WEATHER, "type": "custom", "cache_control": {"type": "ephemeral"}}]},
    {"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
    {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
    {"tools": [WEATHER], "tool_choice": {"type": "none"}, "messages": TOOL_TURNS},
    {"tools": [WEATHER], "messages": TOOL_TURNS[:2] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1"}, {"type": "tool_result", "tool_use_id": "toolu_2",
                                                            "content": []}]}]},
])
def test_a_request_with_tools_passes_as_anthropic_takes_it(extra: dict[str, Any]) -> None:
    check_request({"model": "m", "max_tokens": 4, "messages": CHAT, **extra})


def use(**fields: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}, **fields}]}


def result(**fields: Any) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", **fields}]}


@pytest.mark.parametrize("body, param", [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": ["f"]}, "tools.0"),
    ({"tools": [{**WEATHER, "type": "web_search_20250305"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "name": "get weather"}]}, "tools.0.name"),
    ({"tools": [{**WEATHER, "name": "x" * 129}]}, "tools.0.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ({"tools": [{**WEATHER, "description": 3}]}, "tools.0.description"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use"),
    ({"messages": [{"role": "user", "content": use()["content"]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "assistant", "content": result()["content"]}]}, "messages.0.content.0"),
    ({"messages": [use(id="")]}, "messages.0.content.0.id"),
    ({"messages": [use(name=None)]}, "messages.0.content.0.name"),
    ({"messages": [use(input="{}")]}, "messages.0.content.0.input"),
    ({"messages": [result(tool_use_id=7)]}, "messages.0.content.0.tool_use_id"),
    ({"messages": [result(is_error="no")]}, "messages.0.content.0.is_error"),
    ({"messages": [result(content=3)]}, "messages.0.content.0.content"),
    ({"messages": [result(content=[{"type": "document"}])]}, "messages.0.content.0.content.0"),
    ({"messages": [result(content=[{"type": "image", "source": {"type": "file"}}])]},
     "messages.0.content.0.content.0.source"),
])
def test_a_malformed_tool_is_refused_naming_where(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_request({"model": "m", "max_tokens": 4, "messages": CHAT, **body})
    assert (refused.value.status, refused.value.param) == (400, param)
    assert f"`{param}`" in refused.value.message


def test_tools_and_their_turns_become_chats_functions_calls_and_tool_messages() -> None:
    body = {"model": "m", "max_tokens": 8, "messages": TOOL_TURNS, "tools": [WEATHER, {**WEATHER, "name": "x",
                                                                                      "description": ""}],
            "tool_choice": {"type": "tool", "name": "x", "disable_parallel_tool_use": True}}
    check_request(body)
    chat = to_chat(body)
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                          "description": "The weather in a city"}},
        {"type": "function", "function": {"name": "x", "parameters": WEATHER["input_schema"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ({"type": "function", "function": {"name": "x"}}, False)
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        # The tool messages first, at once after the calls (chat's rule); the result's image and the
        # turn's text after them, as the user's.
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                                     {"type": "text", "text": "Thanks"}]}]
    only_calls = to_chat({"model": "m", "max_tokens": 1, "messages": [use()]})["messages"]
    assert only_calls == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert [m["role"] for m in to_chat({"model": "m", "max_tokens": 1, "messages": [result()]})["messages"]] == ["tool"]
    auto = to_chat({"model": "m", "max_tokens": 1, "messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "any"}})
    assert (auto["tool_choice"], "parallel_tool_calls" in auto) == ("required", False)


def test_a_chat_completions_tool_calls_are_the_sdks_tool_use_blocks() -> None:
    chat = {"choices": [{"message": {"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": '}},   # a model's bad JSON
        {"id": "call_3", "function": {"name": "f", "arguments": {"already": "an object"}}}, "junk"]},
        "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 9, "completion_tokens": 7}}
    message = to_message(chat, "m", "msg_t")
    final = sdk(200, json.dumps(message).encode()).messages.create(model="m", max_tokens=4, messages=CHAT)  # type: ignore[arg-type]
    blocks = [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content]
    assert blocks == [("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_weather", {}),
                      ("tool_use", "f", {"already": "an object"})]
    ids = [b.id for b in final.content]  # type: ignore[union-attr]
    assert ids[0] == "call_1" and ids[1].startswith("toolu_") and ids[2] == "call_3"
    assert final.stop_reason == "tool_use"
    with_text = to_message({"choices": [{"message": {"content": "Let me look.", "tool_calls": chat["choices"][0][
        "message"]["tool_calls"][:1]}, "finish_reason": "tool_calls"}]}, "m", "msg")
    assert [b["type"] for b in with_text["content"]] == ["text", "tool_use"]


def tool_chunk(index: int | None, arguments: str | None = None, call_id: str | None = None,
               name: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"function": {}}
    if index is not None:
        call["index"] = index
    if call_id is not None:
        call.update(id=call_id, type="function")
    if name is not None:
        call["function"]["name"] = name
    if arguments is not None:
        call["function"]["arguments"] = arguments
    return {"choices": [{"delta": {"tool_calls": [call]}}]}


def test_a_streamed_tool_call_is_the_sdks_tool_use_block_whole() -> None:
    stream = MessageStream("m", "msg_s")
    chunks = [{"choices": [{"delta": {"content": "Checking"}}]}, {"choices": [{"delta": {"content": " both."}}]},
              tool_chunk(0, "", "call_a", "get_weather"), tool_chunk(0, '{"ci'), tool_chunk(0, 'ty": "Par'),
              tool_chunk(0, 'is"}'), tool_chunk(1, '{"city": "Rome"}', "call_b", "get_weather"),
              {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 12}}]
    raw = stream.start() + b"".join(stream.feed(c) for c in chunks) + stream.end()
    names = [name for name, _ in events_of(raw)]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start"] + ["content_block_delta"] * 3 + [
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    with sdk(200, raw, "text/event-stream").messages.stream(model="m", max_tokens=4, messages=CHAT) as s:  # type: ignore[arg-type]
        final = s.get_final_message()
    assert [(b.type, getattr(b, "text", None), getattr(b, "id", None), getattr(b, "input", None))
            for b in final.content] == [("text", "Checking both.", None, None),
                                        ("tool_use", None, "call_a", {"city": "Paris"}),
                                        ("tool_use", None, "call_b", {"city": "Rome"})]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("tool_use", 20, 12)


def test_a_stream_of_only_a_tool_call_has_no_text_block_and_pieces_without_index_continue_it() -> None:
    stream = MessageStream("m", "msg_o")
    raw = stream.start() + stream.feed(tool_chunk(None, '{"a":', None, "f")) + stream.feed(tool_chunk(None, " 1}"))
    raw += stream.feed({"choices": [{"delta": {"tool_calls": "junk"}, "finish_reason": "tool_calls"}]}) + stream.end()
    with sdk(200, raw, "text/event-stream").messages.stream(model="m", max_tokens=4, messages=CHAT) as s:  # type: ignore[arg-type]
        final = s.get_final_message()
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == [
        ("tool_use", "f", {"a": 1})]
    assert final.content[0].id.startswith("toolu_")  # type: ignore[union-attr]


@given(st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=6), max_size=4), st.data())
def test_the_sdk_reads_back_the_arguments_however_they_were_cut(arguments: dict[str, Any], data: st.DataObject) -> None:
    text = json.dumps(arguments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream = MessageStream("m", "msg_p")
    raw = stream.start() + stream.feed(tool_chunk(0, "", "call_p", "f"))
    raw += b"".join(stream.feed(tool_chunk(0, p)) for p in pieces) + stream.end()
    with sdk(200, raw, "text/event-stream").messages.stream(model="m", max_tokens=4, messages=CHAT) as s:  # type: ignore[arg-type]
        final = s.get_final_message()
    assert final.content[0].input == arguments  # type: ignore[union-attr]
