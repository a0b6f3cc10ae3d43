"""Backend answers turned into OpenAI errors, request bodies too deep to walk, Retry-After everywhere."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from fakes import FakeSSEResponse
from proxy.errors import BackendError, BackendTimeout, PoolError, Unavailable
from proxy.edge.strict_json import MAX_DEPTH, _deeper_than
from proxy.edge.relay import KNOWN_BACKEND_CODES, Timeouts, backend_error, sse_data


def test_an_html_error_page_becomes_502_backend_error_with_an_excerpt() -> None:
    err = backend_error(500, b"<html><body><h1>500 Internal Server Error</h1></body></html>" + b"x" * 5000,
                        "replica 0 of 'm'")
    assert err.status == 502 and err.code == "backend_error"
    assert "500 Internal Server Error" in err.message and len(err.message) < 400
    assert json.loads(json.dumps(err.body()))["error"]["type"] == "server_error"


def test_an_openai_error_from_the_backend_keeps_its_status_code_and_type() -> None:
    raw = json.dumps({"error": {"message": "context too long", "type": "invalid_request_error",
                                "code": "context_length_exceeded", "param": "messages"}}).encode()
    err = backend_error(400, raw, "replica 0 of 'm'")
    assert (err.status, err.code, err.type, err.param) == (400, "context_length_exceeded", "invalid_request_error",
                                                           "messages")


def test_a_backend_code_reaches_the_client_but_only_well_known_ones_reach_the_metrics() -> None:
    def code_of(code: str) -> PoolError:
        return backend_error(400, json.dumps({"error": {"message": "no", "code": code}}).encode(), "r")
    known = code_of("context_length_exceeded")
    assert known.code == known.metric_code == "context_length_exceeded"
    # An engine's own invention (or a per-request string) would add a label value per request.
    odd = code_of("slot_17_busy_at_1733000000")
    assert odd.body()["error"]["code"] == "slot_17_busy_at_1733000000"
    assert odd.metric_code == "invalid_request_error"   # a 4xx: the client's mistake, counted as one
    failed = backend_error(500, json.dumps({"error": {"message": "no", "code": "slot_17_oom"}}).encode(), "r")
    assert (failed.body()["error"]["code"], failed.metric_code) == ("slot_17_oom", "backend_error")
    assert Unavailable("unloading", code="model_unloading").metric_code == "model_unloading"


def test_every_code_our_shims_answer_with_is_kept_in_the_metrics() -> None:
    # The shims are ours: their codes are a fixed set and say what went wrong, so none may be
    # folded into `backend_error`. Read from their sources, so that a new code cannot be missed.
    code_arg = {"PromptError": 1, "RequestRejected": 1, "_error": 2}   # (message, code) / (status, message, code)
    raised = set()
    for path in (Path(__file__).resolve().parents[3] / "shims").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in code_arg:
                args = node.args[code_arg[node.func.id]:code_arg[node.func.id] + 1]
                raised |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    assert {"modality_unsupported", "multi_turn_unsupported", "model_loading"} <= raised  # the reading works
    assert raised <= KNOWN_BACKEND_CODES, raised - KNOWN_BACKEND_CODES


def test_a_backend_503_keeps_its_retry_after_and_gets_one_if_it_had_none() -> None:
    raw = b'{"error": {"message": "busy"}}'
    assert backend_error(503, raw, "r", retry_after="7").headers() == {"Retry-After": "7"}
    assert backend_error(503, raw, "r").headers()["Retry-After"]


def test_every_429_and_503_carries_retry_after() -> None:
    assert Unavailable("unloading", code="model_unloading").headers()["Retry-After"]
    assert PoolError("queue", status=429).headers()["Retry-After"]
    assert BackendError("x").headers() == {}
    assert BackendTimeout("slow").status == 504 and BackendTimeout("slow").code == "backend_timeout"


def test_depth_is_measured_without_recursion() -> None:
    deep: object = "leaf"
    for _ in range(50_000):
        deep = [deep]
    assert _deeper_than({"a": deep}, MAX_DEPTH)
    assert not _deeper_than({"messages": [{"content": [{"type": "text"}]}]}, MAX_DEPTH)



async def _collect(lines: list[bytes]) -> list[dict]:
    return [c async for c in sse_data(FakeSSEResponse(lines), Timeouts(1, 1), "r")]  # type: ignore[arg-type]


async def test_an_error_chunk_in_a_stream_is_the_backends_error() -> None:
    ok = b'data: {"choices": [{"delta": {"content": "a"}}]}\n'
    error = b'data: {"error": {"code": 500, "message": "KV cache full", "type": "server_error"}}\n'
    with pytest.raises(BackendError, match="KV cache full"):
        await _collect([ok, b"\n", error, b"\n"])
    assert len(await _collect([ok, b"\n", b": ping\n", b"data: [DONE]\n"])) == 1


def test_a_backend_refusal_is_the_clients_mistake_in_openais_words() -> None:
    # What the pinned llama-server answers to a prompt over its context: its own type, an int code.
    raw = json.dumps({"error": {"code": 400, "message": "the request exceeds the available context size, try "
                                "increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 900,
                                "n_ctx": 512}}).encode()
    err = backend_error(400, raw, "replica 0 of 'demo'")
    assert (err.status, err.type, err.code, err.metric_code) == (
        400, "invalid_request_error", "context_length_exceeded", "context_length_exceeded")
    assert err.message.startswith("the request exceeds the available context size")
    # vLLM's words for the same thing.
    raw = json.dumps({"error": {"message": "This model's maximum context length is 512 tokens. However, you "
                                "requested 900 tokens.", "type": "BadRequestError", "code": 400}}).encode()
    assert (backend_error(400, raw, "r").code, backend_error(400, raw, "r").type) == (
        "context_length_exceeded", "invalid_request_error")
    # Any other refusal keeps the backend's message and is an invalid request, never backend_error.
    raw = json.dumps({"error": {"code": 400, "message": "[json.exception.type_error.302] type must be string",
                                "type": "invalid_request_error"}}).encode()
    err = backend_error(422, raw, "r")
    assert (err.status, err.code, err.metric_code) == (422, "invalid_request_error", "invalid_request_error")
    assert "type must be string" in err.message
    assert backend_error(400, b"<html>bad</html>", "replica 0 of 'm'").code == "invalid_request_error"


async def test_a_deep_body_is_refused_and_a_bracket_heavy_shallow_one_is_not() -> None:
    from proxy.errors import BadRequest
    from proxy.serving.body import read_body

    class Request:   # what read_body reads of an aiohttp request
        def __init__(self, raw: bytes) -> None:
            self.raw = raw

        async def read(self) -> bytes:
            return self.raw

        def get(self, key: object) -> None:
            return None   # no fallback's body (proxy/serving/fallbacks.py)

    with pytest.raises(BadRequest, match="nested more than"):
        await read_body(Request(b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}"))  # type: ignore[arg-type]
    wide = b'{"messages": [' + b", ".join([b"[]"] * 300) + b"]}"   # 600 brackets, 3 levels
    body, raw = await read_body(Request(wide))  # type: ignore[arg-type]
    assert raw == wide and len(body["messages"]) == 300
