"""A batch file's lines (proxy/serving/batch_lines.py): what a line must be, each mistake a 400
naming its line, with nothing kept or run."""
from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import BadRequest
from proxy.serving.batch_lines import parse


def line(custom_id: str = "a", url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}


def jsonl(*lines: Any) -> bytes:
    return b"".join((json.dumps(x) if not isinstance(x, bytes) else x.decode()).encode() + b"\n" for x in lines)


def refused(data: bytes, max_lines: int = 100) -> str:
    with pytest.raises(BadRequest) as info:
        parse(data, max_lines)
    assert info.value.code == "invalid_batch_file"
    return info.value.message


def test_lines_of_every_endpoint_parse_with_their_model_and_body() -> None:
    parsed = parse(jsonl(line("a"), line("b", "/v1/completions", model="m", prompt="x"),
                         line("c", "/v1/embeddings", model="e", input=["x"]),
                         line("d", "/v1/messages", model="m", max_tokens=5, messages=[]),
                         line("e", "/v1/responses", model="m", input="x")), 100)
    assert [(p.custom_id, p.url, p.model) for p in parsed] == [
        ("a", "/v1/chat/completions", "m"), ("b", "/v1/completions", "m"), ("c", "/v1/embeddings", "e"),
        ("d", "/v1/messages", "m"), ("e", "/v1/responses", "m")]
    assert json.loads(parsed[1].body) == {"model": "m", "prompt": "x"}


def test_a_file_ending_without_a_newline_and_with_crlf_lines_parses() -> None:
    data = jsonl(line("a")).replace(b"\n", b"\r\n") + json.dumps(line("b")).encode()
    assert [p.custom_id for p in parse(data, 100)] == ["a", "b"]


@pytest.mark.parametrize("data, says", [
    (b"", "the file holds no line"),
    (b"\n\n", "the file holds no line"),
    (jsonl(line("a"), b"", line("b")), "line 2: the line is empty"),
    (jsonl(line("a"), b"{not json"), "line 2: the line is not valid JSON"),
    (jsonl(b"[1]"), "line 1: the line must be a JSON object"),
    (jsonl({**line(), "extra": 1}), "line 1: unknown field(s) ['extra']"),
    (jsonl(line(""),), "line 1: custom_id must be a string of 1 to 512 characters"),
    (jsonl({**line(), "custom_id": 7}), "custom_id must be a string"),
    (jsonl(line("x" * 513)), "custom_id must be a string of 1 to 512"),
    (jsonl(line("a"), line("a")), "line 2: custom_id 'a' is on an earlier line too"),
    (jsonl({**line(), "method": "GET"}), "line 1: method must be POST"),
    (jsonl(line(url="/v1/rerank")), "line 1: url must be one of"),
    (jsonl({**line(), "body": "text"}), "line 1: body must be a JSON object"),
    (jsonl(line(messages=[])), "line 1: body.model is required and must be a non-empty string"),
    (jsonl(line(model="m", messages=[], stream=True)), "line 1: body.stream must be false"),
    (jsonl(line(model="m")), "line 1: body.messages is required for /v1/chat/completions and must be an array"),
    (jsonl(line(url="/v1/messages", model="m", messages=[])), "body.max_tokens is required for /v1/messages"),
    (jsonl(line(url="/v1/messages", model="m", messages=[], max_tokens=True)), "body.max_tokens is required"),
    (jsonl(line(url="/v1/responses", model="m")), "body.input is required for /v1/responses"),
    (b"\xef\xbb\xbf" + jsonl(line()), "line 1: the line starts with a byte order mark"),
])
def test_each_wrong_line_is_named(data: bytes, says: str) -> None:
    assert says in refused(data)


def test_more_lines_than_max_lines_is_refused_before_any_is_read() -> None:
    assert "the file has 3 lines; a batch holds at most 2 (engine.batches.max_lines)" in \
        refused(jsonl(line("a"), line("b"), b"{broken"), max_lines=2)
