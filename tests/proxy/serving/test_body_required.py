"""check_required: what each pass-through endpoint needs is refused at the edge when missing or of
the wrong JSON type, down to the items of `messages` (found by the contract fuzzer: `messages:
[null]` reached the sim, whose 500 became a 502 and a failure counted against the replica)."""
from __future__ import annotations

import pytest

from proxy.errors import BadRequest
from proxy.serving.body import check_required

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("messages", [[None], ["hi"], [{"role": "user", "content": "x"}, 3]])
def test_a_message_that_is_not_an_object_is_an_invalid_type_naming_it(messages: list[object]) -> None:
    with pytest.raises(BadRequest) as caught:
        check_required(CHAT, {"model": "m", "messages": messages})
    index = next(i for i, m in enumerate(messages) if not isinstance(m, dict))
    assert (caught.value.code, caught.value.param, caught.value.status) == ("invalid_type", f"messages.{index}", 400)


def test_messages_that_are_objects_pass() -> None:
    check_required(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]})


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    (CHAT, {}, "messages", "missing_required_parameter"),
    (CHAT, {"messages": []}, "messages", "invalid_type"),
    ("/v1/completions", {"prompt": 5}, "prompt", "invalid_type"),
    ("/v1/embeddings", {"input": [None]}, None, None),   # items of other endpoints are the backend's to judge
    ("/v1/rerank", {"query": "q"}, "documents", "missing_required_parameter"),
    ("/v1/rerank", {"query": "q", "documents": ["a", 1]}, "documents.1", "invalid_type"),
    ("/v1/rerank", {"query": 1, "documents": ["a"]}, "query", "invalid_type"),
    ("/v1/rerank", {"query": "q", "documents": ["a"]}, None, None),
    ("/infill", {"input_suffix": ")"}, "input_prefix", "missing_required_parameter"),
    ("/tokenize", {"content": ["x"]}, "content", "invalid_type"),
    ("/detokenize", {"tokens": [1, True]}, "tokens.1", "invalid_type"),   # a bool is no token id
    ("/detokenize", {"tokens": [1, 2]}, None, None),
    ("/v1/messages/count_tokens", {"messages": [None]}, "messages.0", "invalid_type"),
])
def test_the_required_field(path: str, body: dict[str, object], param: str | None, code: str | None) -> None:
    if code is None:
        check_required(path, body)
        return
    with pytest.raises(BadRequest) as caught:
        check_required(path, body)
    assert (caught.value.code, caught.value.param) == (code, param)
