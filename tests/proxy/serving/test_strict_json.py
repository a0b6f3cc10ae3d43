"""A body is decoded once, strictly, at the edge (issue 28, items 3 and 6): UTF-8 JSON without a BOM,
NaN, Infinity or a lone surrogate, within bounds on its objects and values, or a 400 `invalid_json`;
what a replica gets is then exactly what was checked.

Real HTTP on loopback: a client, the proxy's public routes, and one READY replica that is a fake
llama-server (tests/fakes.py) recording every request it reads. `json.loads` on bytes guessed
UTF-16 and UTF-32 and took a BOM: such a body passed the image-URL check's scan of the bytes, and
its bytes, not what was checked, reached the replica."""
from __future__ import annotations

import base64
import contextlib
import json
import os
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest

from fakes import FakeLlamaServerHTTP, FakeSupervisor
from in_process import in_rotation, serve_routes
from launchers import llama_server
from proxy.config.loading import load_settings
from proxy.errors import BadRequest
from proxy.lifecycle.pool import Pool
from proxy.upstream.reach import ProgramReach
from proxy.lifecycle.state.replicas import Replica, ReplicaState
from proxy.serving.body import read_json
from proxy.serving.forward import upstream_session
from proxy.serving.responses import MAX_CONTENT_ITEMS, MAX_CONTENT_ITEMS_TOTAL, parse
from proxy.edge.strict_json import MAX_CONTAINERS, MAX_VALUES, decode

METADATA = "http://169.254.169.254/latest/meta-data/"
CHAT = {"model": "m", "messages": [{"role": "user", "content": [
    {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": METADATA}}]}]}


class Edge:
    """The proxy's public routes on a loopback port, in front of one READY fake replica."""

    def __init__(self, url: str, client: aiohttp.ClientSession, replica: Replica, fake: FakeLlamaServerHTTP) -> None:
        self.url, self.client, self.replica, self.fake = url, client, replica, fake

    async def post(self, raw: bytes, path: str = "/v1/chat/completions") -> tuple[int, dict[str, Any]]:
        async with self.client.post(self.url + path, data=raw, headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json()

    def untouched(self) -> bool:
        """Nothing reached the replica, and it is in rotation with no failure counted."""
        return not self.fake.requests and self.replica.state == ReplicaState.READY and self.replica.failures == 0


@pytest.fixture
async def edge(tmp_path: Path) -> AsyncIterator[Edge]:
    async with contextlib.AsyncExitStack() as stack:
        fake = await stack.enter_async_context(FakeLlamaServerHTTP())
        (tmp_path / "pool.yaml").write_text(
            f"service: {{state_dir: {tmp_path}}}\n"
            f"engine: {{models: {{m: {{backend: llama_server, model_path: {tmp_path / 'm.gguf'}, "
            "llama_server_binary: /bin/true, target_inflight: 2, modalities: [text, image], "
            f"llama_server_mmproj_path: {tmp_path / 'mm.gguf'}}}}}}}\n")
        settings = load_settings(tmp_path / "pool.yaml")
        http = await stack.enter_async_context(upstream_session())
        pool = Pool(settings, FakeSupervisor(), http, environ={})  # type: ignore[arg-type]
        spec = llama_server.launch(settings.models["m"], 0, fake.port, 5, {})
        replica = Replica(model="m", index=0, spec=spec, fullname="m:r0", pid=os.getpid(), reach=ProgramReach(spec))
        in_rotation(pool, "m", [replica])
        url = await serve_routes(stack, settings, pool, http)
        client = await stack.enter_async_context(aiohttp.ClientSession())
        yield Edge(url, client, replica, fake)


async def test_the_image_url_in_utf8_is_refused_by_its_rule(edge: Edge) -> None:
    status, answer = await edge.post(json.dumps(CHAT).encode())
    assert status == 400 and answer["error"]["code"] == "image_url_not_allowed", answer
    assert edge.untouched()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-sig"])
async def test_a_body_not_in_plain_utf8_is_invalid_json_and_never_reaches_the_replica(edge: Edge,
                                                                                       encoding: str) -> None:
    status, answer = await edge.post(json.dumps(CHAT).encode(encoding))
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert "UTF-8" in answer["error"]["message"]
    assert edge.untouched()


async def test_responses_reads_the_same_way(edge: Edge) -> None:
    body = {"model": "m", "input": [{"type": "image_url", "image_url": {"url": METADATA}}]}
    status, answer = await edge.post(json.dumps(body).encode("utf-16"), "/v1/responses")
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert edge.untouched()


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
async def test_a_number_json_has_not_is_invalid_json(edge: Edge, number: str) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": ' + number.encode() + b"}"
    status, answer = await edge.post(raw)
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert number.lstrip("-") in answer["error"]["message"]
    assert edge.untouched()


async def test_an_unpaired_surrogate_escape_is_invalid_json_and_a_pair_passes(edge: Edge) -> None:
    lone = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud83d b"}]}'
    status, answer = await edge.post(lone)
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert "surrogate" in answer["error"]["message"]
    assert edge.untouched()
    status, _ = await edge.post(lone.replace(b"\\ud83d", b"\\uD83D\\ude00"))   # an escaped emoji
    assert status == 200
    assert edge.fake.requests[0][2]["messages"][0]["content"] == "a\U0001F600 b"


async def test_too_many_objects_is_invalid_json_naming_the_bound(edge: Edge) -> None:
    raw = b'{"model": "m", "messages": [' + b",".join([b'{"role": "user"}'] * MAX_CONTAINERS) + b"]}"
    status, answer = await edge.post(raw)
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert f"{MAX_CONTAINERS + 2} JSON objects and arrays; at most {MAX_CONTAINERS}" in answer["error"]["message"]
    assert edge.untouched()


# Counted: each value after an opening bracket or a comma; the body around `x` holds 6 more.
@pytest.mark.parametrize("item, count, words", [
    (b"1", MAX_VALUES, f"holds {MAX_VALUES + 6} JSON values; at most {MAX_VALUES} are accepted"),
    (b'""', MAX_VALUES, f"holds {MAX_VALUES + 6} JSON values; at most {MAX_VALUES} are accepted"),
    # So many strings that they alone are too many values: refused before they are counted one by one.
    (b'""', 2 * MAX_VALUES + 2, f"holds more than {MAX_VALUES} JSON values; at most {MAX_VALUES} are accepted"),
])
async def test_too_many_values_is_invalid_json_naming_the_bound(edge: Edge, item: bytes, count: int,
                                                               words: str) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": [' + b",".join([item] * count) + b"]}"
    status, answer = await edge.post(raw)
    assert status == 400 and answer["error"]["code"] == "invalid_json", answer
    assert words in answer["error"]["message"]
    assert edge.untouched()


@pytest.mark.parametrize("code", ['{"a": [1, 2], "b\\\\": "\\"[{"}, ', "f([{a, b}], c) "])
async def test_brackets_and_commas_inside_strings_do_not_count(edge: Edge, code: str) -> None:
    # Code in a prompt: more brackets and commas than the bounds allow, all of them text (with
    # escaped quotes and backslashes, and without).
    text = code * (MAX_VALUES // 3)
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    status, _ = await edge.post(json.dumps(body).encode())
    assert status == 200
    assert edge.fake.requests[0][2]["messages"][0]["content"] == text


async def test_a_large_image_data_url_passes_as_it_came(edge: Edge) -> None:
    image = base64.b64encode(os.urandom(6 * 1024 * 1024)).decode()   # 8 MiB of base64
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}], "max_tokens": 4}
    status, answer = await edge.post(json.dumps(body).encode())
    assert status == 200, answer
    assert edge.fake.requests[0][2] == body


async def test_admin_bodies_are_read_the_same_way() -> None:
    class Request:   # what read_json reads of an aiohttp request
        async def read(self) -> bytes:
            return json.dumps({"replicas": 1}).encode("utf-16")

        def get(self, key: object) -> None:
            return None   # no fallback's body (proxy/serving/fallbacks.py)

    with pytest.raises(BadRequest) as caught:
        await read_json(Request())  # type: ignore[arg-type]
    assert caught.value.code == "invalid_json"


@pytest.mark.parametrize("raw, words", [
    (b"\xef\xbb\xbf{}", "byte order mark"),
    ('{"a": "\u00e9"}'.encode("latin-1"), "not UTF-8 (at byte 7)"),
    (b'{"a": "\xed\xa0\x80"}', "not UTF-8"),   # an encoded surrogate
    (b'{"a": 1,}', "not valid JSON: Expecting property name enclosed in double quotes (line 1, column 9)"),
    (b"[]", "must be a JSON object"),
    (b'{"a": 1' + b"0" * 5000 + b"}", "too many digits"),
])
def test_each_refusal_says_why(raw: bytes, words: str) -> None:
    with pytest.raises(BadRequest) as caught:
        decode(raw)
    assert caught.value.code == "invalid_json" and words in caught.value.message


def test_responses_bound_the_content_items_of_all_messages_together() -> None:
    # Each message within its own bound, the request over the total: jsonschema walks every item
    # (~0.15 ms each), so the total is what bounds the time a request's check takes.
    per = MAX_CONTENT_ITEMS
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}] * per}] * \
        (MAX_CONTENT_ITEMS_TOTAL // per + 1)
    with pytest.raises(BadRequest) as caught:
        parse({"model": "m", "messages": messages})
    assert (caught.value.code, caught.value.param) == ("invalid_request", "messages")
    parse({"model": "m", "messages": messages[:-1]})


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "input": [{"type": "text", "text": "x"}] * 100_000}, "input"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}] * 100_000}, "messages"),
    ({"model": "m", "input": "x", "decoding": {"stop": ["a"] * 100_000}}, "decoding.stop"),
])
def test_responses_refuse_a_long_list_by_its_length(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse(body)
    assert (caught.value.code, caught.value.param) == ("invalid_request", param)
    assert "100000 items, over the bound" in caught.value.message
