"""proxy/edge/ollama.py: Ollama's fields as the pool's, and back, without a server."""
from __future__ import annotations

import json

import pytest

from proxy.capabilities import Capabilities, Traits
from proxy.edge import ollama
from proxy.errors import BadRequest

TEXT = Capabilities(modalities=("text",), multi_turn=True, file_inputs=False, thinking_modes=("default",))
VISION = Capabilities(modalities=("text", "image"), multi_turn=True, file_inputs=False, thinking_modes=("default",))
ENGINE = Traits(multi_turn=True, repetition_field="repeat_penalty")
PROVIDER = Traits(multi_turn=True, decoding_only=("max_tokens", "temperature", "top_p"), remote=True)
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="


@pytest.mark.parametrize("value, seconds", [
    (300, 300.0), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5), ("250ms", 0.25), ("-1", -1.0),
    (-1, -1.0), ("-5m", -300.0), (0, 0.0), (None, None)])
def test_keep_alive_is_seconds_or_gos_duration(value: object, seconds: float | None) -> None:
    assert ollama.keep_alive_s(value) == seconds


@pytest.mark.parametrize("value", ["soon", "", "5 minutes", "m", True, [5]])
def test_a_keep_alive_that_is_no_duration_is_a_400(value: object) -> None:
    with pytest.raises(BadRequest) as info:
        ollama.keep_alive_s(value)
    assert info.value.param == "keep_alive"


def test_options_become_the_engines_fields_and_the_rest_is_named() -> None:
    fields, skipped = ollama.sampling({"temperature": 0.2, "top_k": 40, "num_predict": 64, "repeat_penalty": 1.1,
                                       "seed": 7, "stop": "END", "num_gpu": 99, "mirostat": 2, "num_ctx": 1024},
                                      ENGINE, (2048, "llama_server_n_ctx"))
    assert fields == {"temperature": 0.2, "top_k": 40, "max_tokens": 64, "repeat_penalty": 1.1, "seed": 7,
                      "stop": ["END"]}
    assert skipped == ["options.num_gpu", "options.mirostat"]
    # A provider takes only OpenAI's few: the others are named, never sent.
    fields, skipped = ollama.sampling({"temperature": 0.2, "top_k": 40, "num_predict": -1, "repeat_penalty": 1.1},
                                      PROVIDER, None)
    assert fields == {"temperature": 0.2}
    assert skipped == ["options.top_k", "options.repeat_penalty"]


@pytest.mark.parametrize("options, param, words", [
    ({"temperature": "hot"}, "options.temperature", "not a number"),
    ({"temperature": -1}, "options.temperature", "not a number of 0 or more"),
    ({"top_k": 1.5}, "options.top_k", "not an integer"),
    ({"num_predict": 0}, "options.num_predict", "generates nothing"),
    ({"stop": [""]}, "options.stop", "non-empty strings"),
    ({"num_ctx": 4096}, "options.num_ctx", "more than this model's context (2048 tokens, llama_server_n_ctx)"),
    ([], "options", "must be an object"),
])
def test_a_wrong_option_is_a_400_naming_it(options: object, param: str, words: str) -> None:
    with pytest.raises(BadRequest) as info:
        ollama.sampling(options, ENGINE, (2048, "llama_server_n_ctx"))
    assert info.value.param == param and words in info.value.message


def test_format_is_response_format() -> None:
    assert ollama.response_format("json") == {"type": "json_object"}
    assert ollama.response_format("") is None and ollama.response_format(None) is None
    schema = {"type": "object"}
    assert ollama.response_format(schema) == {"type": "json_schema",
                                              "json_schema": {"name": "format", "schema": schema, "strict": True}}
    with pytest.raises(BadRequest):
        ollama.response_format("yaml")


def test_messages_carry_images_and_tool_calls_as_chat_does() -> None:
    messages = ollama.chat_messages([
        {"role": "user", "content": "what is this?", "images": [PNG]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "look", "arguments": {"at": "it"}}},
            {"function": {"name": "ask", "arguments": {}}}]},
        {"role": "tool", "content": "asked", "tool_name": "ask"},
        {"role": "tool", "content": "looked"},
    ], VISION, "m")
    assert messages[0]["content"] == [{"type": "text", "text": "what is this?"},
                                      {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_0", "call_1"]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"at": "it"}
    # Each tool message answers the call of its tool_name, else the first unanswered one.
    assert (messages[2]["tool_call_id"], messages[3]["tool_call_id"]) == ("call_1", "call_0")


@pytest.mark.parametrize("messages, caps, param", [
    ([{"role": "user", "content": "hi", "images": [PNG]}], TEXT, "messages.0.images"),
    ([{"role": "user", "content": "hi", "images": ["not base64!"]}], VISION, "messages.0.images.0"),
    ([{"role": "tool", "content": "18 degrees"}], TEXT, "messages.0"),
    ([{"role": "user", "content": 5}], TEXT, "messages.0.content"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[]"}}]}], TEXT,
     "messages.0.tool_calls.0.function.arguments"),
    ({"role": "user"}, TEXT, "messages"),
])
def test_a_wrong_message_is_a_400_naming_it(messages: object, caps: Capabilities, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        ollama.chat_messages(messages, caps, "m")
    assert info.value.param == param


def test_raw_needs_a_completions_endpoint() -> None:
    ollama.check_generate({"prompt": "hi", "raw": True}, completions=True)
    with pytest.raises(BadRequest) as info:
        ollama.check_generate({"prompt": "hi", "raw": True}, completions=False)
    assert (info.value.param, info.value.code) == ("raw", "endpoint_unsupported")


def test_a_streams_tool_call_goes_out_whole_before_the_done_line() -> None:
    stream = ollama.Stream("m", chat=True)
    assert stream.text("") == b""
    stream.call_pieces([{"index": 0, "id": "c", "function": {"name": "get_weather", "arguments": '{"ci'}}])
    stream.call_pieces([{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}, "junk"])
    lines = [json.loads(line) for line in stream.end(ollama.done_fields("tool_calls", {"prompt_tokens": 3,
                                                                                      "completion_tokens": 5},
                                                                        None, (10, 0, 4, 6))).splitlines()]
    assert lines[0]["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert lines[0]["done"] is False
    done = lines[1]
    assert (done["done"], done["done_reason"], done["prompt_eval_count"], done["eval_count"]) == (True, "stop", 3, 5)
    assert (done["total_duration"], done["prompt_eval_duration"], done["eval_duration"]) == (10, 4, 6)


def test_an_engines_own_times_win_and_untrusted_counts_are_none() -> None:
    done = ollama.done_fields("length", {"prompt_tokens": 10**30, "completion_tokens": "5"},
                              {"prompt_ms": 2.5, "predicted_ms": 10, "predicted_n": 4}, (1, 0, 2, 3))
    assert (done["done_reason"], done["prompt_eval_count"], done["eval_count"]) == ("length", 0, 4)
    assert (done["prompt_eval_duration"], done["eval_duration"]) == (2_500_000, 10_000_000)


def test_a_name_with_latest_is_the_models() -> None:
    assert ollama.model_name({"model": "demo:latest"}) == "demo"
    assert ollama.model_name({"model": "qwen3:8b"}) == "qwen3:8b"
    with pytest.raises(BadRequest) as info:
        ollama.model_name({"model": ""})
    assert info.value.param == "model"
