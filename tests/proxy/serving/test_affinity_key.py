"""A request's affinity key: prompt_cache_key, else X-Session-Id, else a hash of the prompt's start;
never the fairness key, and nothing at all for least_loaded models or embeddings."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator, Mapping

import pytest

from proxy.config.model import DEFAULT_ROUTING, ModelConfig
from proxy.errors import BadRequest
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving.affinity_key import affinity_key, digest

CONFIG = ModelConfig(name="m", backend="llama_server", enabled=True, replicas=2, replica_max=2, target_inflight=2,
                     modalities=("text",), gpus=(), options=dict(DEFAULT_ROUTING))
CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You answer questions about the attached contract. " * 20}


def runtime(**options: Any) -> ModelRuntime:
    return ModelRuntime(config=replace(CONFIG, options={**CONFIG.options, **options}))


def turns(first_question: str, n: int) -> list[dict[str, Any]]:
    """The messages of turn `n` (1-based) of one conversation."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first_question}]
    for i in range(1, n):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"follow-up {i}"}]
    return messages


def test_every_turn_of_a_conversation_has_the_same_key() -> None:
    rt = runtime()
    keys = {affinity_key(rt, CHAT, {}, {"messages": turns("What is clause 4?", n)}) for n in range(1, 6)}
    assert len(keys) == 1 and next(iter(keys)).startswith("p:")


def test_two_conversations_have_different_keys() -> None:
    rt = runtime()
    a = affinity_key(rt, CHAT, {}, {"messages": turns("What is clause 4?", 2)})
    b = affinity_key(rt, CHAT, {}, {"messages": turns("Who signed it?", 2)})
    assert a != b


def test_prompt_cache_key_comes_first_then_the_session_header() -> None:
    rt = runtime()
    body = {"messages": turns("q", 1), "prompt_cache_key": "user-42"}
    assert affinity_key(rt, CHAT, {"X-Session-Id": "s-1"}, body) == digest("c", "user-42")
    assert affinity_key(rt, CHAT, {"X-Session-Id": "s-1"}, {"messages": turns("q", 1)}) == digest("s", "s-1")
    # The same session with other messages keeps its key: the header wins over the prefix.
    assert affinity_key(rt, CHAT, {"X-Session-Id": "s-1"}, {"messages": turns("other", 3)}) == digest("s", "s-1")


def test_the_fairness_key_is_never_the_affinity_key() -> None:
    rt = runtime()
    one = affinity_key(rt, CHAT, {"X-Fairness-Key": "team-a"}, {"messages": turns("q1", 1), "fairness_key": "team-a"})
    two = affinity_key(rt, CHAT, {"X-Fairness-Key": "team-a"}, {"messages": turns("q2", 1), "fairness_key": "team-a"})
    assert one != two
    assert one != digest("c", "team-a") and one != digest("s", "team-a")


def test_a_prompt_is_keyed_by_its_first_characters() -> None:
    rt = runtime(affinity_prefix_chars=32)
    doc = "A long document that a batch of questions shares. " * 10
    a = affinity_key(rt, "/v1/completions", {}, {"prompt": doc + "Question 1"})
    b = affinity_key(rt, "/v1/completions", {}, {"prompt": doc + "Question 2"})
    c = affinity_key(rt, "/v1/completions", {}, {"prompt": "Another document entirely. " * 10})
    assert a == b != c
    tokens = affinity_key(rt, "/v1/completions", {}, {"prompt": [1, 2, 3, 4]})
    assert tokens is not None and tokens != affinity_key(rt, "/v1/completions", {}, {"prompt": [1, 9, 9, 9]})


def test_a_message_is_keyed_by_its_first_characters_only() -> None:
    rt = runtime(affinity_prefix_chars=16)
    a = affinity_key(rt, CHAT, {}, {"messages": [{"role": "user", "content": "0123456789abcdef-one"}]})
    b = affinity_key(rt, CHAT, {}, {"messages": [{"role": "user", "content": "0123456789abcdef-two"}]})
    parts = affinity_key(rt, CHAT, {}, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "0123456789abcdef-three"}]}]})
    assert a == b == parts


def test_least_loaded_and_embeddings_have_no_key_and_least_loaded_reads_nothing_else() -> None:
    class OnlyCacheKey(Mapping[str, Any]):
        """A body that fails the test if anything but prompt_cache_key is read from it."""

        def __getitem__(self, name: str) -> Any:
            if name != "prompt_cache_key":
                raise AssertionError(f"read {name!r}")
            raise KeyError(name)

        def __iter__(self) -> Iterator[str]:
            raise AssertionError("walked the body")

        def __len__(self) -> int:
            return 1

    assert affinity_key(runtime(routing="least_loaded"), CHAT, {"X-Session-Id": "s"}, OnlyCacheKey()) is None
    assert affinity_key(runtime(), "/v1/embeddings", {}, {"input": "text"}) is None
    with pytest.raises(AssertionError):   # the guard works: an affinity model does read the messages
        affinity_key(runtime(), CHAT, {}, OnlyCacheKey())


def test_a_prompt_cache_key_that_is_not_a_string_is_a_400() -> None:
    for rt in (runtime(), runtime(routing="least_loaded")):
        with pytest.raises(BadRequest) as err:
            affinity_key(rt, CHAT, {}, {"messages": turns("q", 1), "prompt_cache_key": 42})
        assert (err.value.status, err.value.param) == (400, "prompt_cache_key")


def test_responses_are_keyed_by_the_chat_messages_the_backend_gets() -> None:
    rt = runtime()
    body = {"input": "What is clause 4?", "instructions": SYSTEM["content"]}
    payload = {"messages": [SYSTEM, {"role": "user", "content": "What is clause 4?"}]}
    assert affinity_key(rt, "/v1/responses", {}, body, payload) == \
        affinity_key(rt, CHAT, {}, {"messages": turns("What is clause 4?", 3)})
