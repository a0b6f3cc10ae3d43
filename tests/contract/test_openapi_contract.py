"""schemathesis against a live `llm-pool serve` (real supervisord, sim replicas), from the proxy's
own GET /openapi.json: generated requests, valid and invalid, on every operation, and stateful
walks over the admin links (load, scale, unload, load again).

What must hold for every response: no 500 of the proxy's own; every 4xx/5xx the OpenAI envelope
(Anthropic's error shape on /v1/messages and its count_tokens, Ollama's on /api/*) with a documented code (errors.CODES; a backend's own code only on an answer that names its replica
in X-Replica); Retry-After on every 429 and 503; the status, content type, headers and body as the
document describes them; a request the document calls invalid is refused with a 4xx (never sent
on to a replica, whose answer to it was a 500 once: `messages: [null]`). After the stateful walks the pool can still load and serve the model.

Bounded for CI: EXAMPLES per operation (LLM_POOL_CONTRACT_EXAMPLES raises it for a longer hunt).
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from helpers import ProxyProcess, http, wait_for
from proxy.errors import CODES
from proxy.edge.anthropic import ANTHROPIC_ERROR_TYPES
from proxy.edge.anthropic import route as anthropic_route
from proxy.edge.ollama import route as ollama_route
from proxy.serving import openapi

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("LLM_POOL_CONTRACT_EXAMPLES", "40"))
TOKEN = "contract-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SIM = {"max_seqs": 8, "decode_tokens_per_s": 2000, "ttft_ms": 1}
MODELS: dict[str, dict[str, Any]] = {
    "loaded": {"backend": "sim", "enabled": True, "replicas": 1, "replica_max": 2, "target_inflight": 4, "sim": SIM},
    "cold": {"backend": "sim", "enabled": False, "replicas": 1, "replica_max": 2, "sim": SIM},
}
# Fuzzed load overrides may set the sim's fault knobs (a hang, a stall): the proxy's own timeouts
# must then answer, well inside the client's.
SERVICE = {"admin_token_env": "LLM_POOL_CONTRACT_TOKEN", "first_byte_timeout_s": 3, "stream_idle_timeout_s": 3,
           "drain_timeout_s": 2, "health_interval_s": 0.5}
CLIENT_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def proxy() -> Iterator[ProxyProcess]:
    started = ProxyProcess(MODELS, service=SERVICE, engine={"fairness": {"max_queue_wait_s": 3}})
    started.env["LLM_POOL_CONTRACT_TOKEN"] = TOKEN
    try:
        started.start()
        wait_for(lambda: http("GET", started.url + "/ready")[0] == 200, what="the startup load")
        status, _, body = http("GET", started.url + "/v1/admin/models", headers=AUTH)
        assert status == 200, body
        yield started
    finally:
        survivors = started.cleanup()
        assert not survivors, f"processes outlived the test and were killed: {survivors}"


@pytest.fixture(scope="module")
def api(proxy: ProxyProcess) -> Any:
    return schemathesis.openapi.from_url(proxy.url + "/openapi.json")


def _body(response: Any) -> Any:
    try:
        return json.loads(response.content)
    except ValueError:
        return None


def no_500_of_the_proxy(ctx: Any, response: Any, case: Any) -> None:
    """A 500 is a bug of the proxy; only a backend's own 500, passed on, names its replica."""
    assert response.status_code != 500 or "X-Replica" in response.headers, \
        f"500 from the proxy: {response.content[:500]!r}"


def errors_are_the_envelope_with_a_documented_code(ctx: Any, response: Any, case: Any) -> None:
    if response.status_code < 400 or (case.path == "/ready" and response.status_code == 503):
        return
    body = _body(response)
    if ollama_route(case.path):
        # Ollama's shape: its clients raise the message as ResponseError.
        assert isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str), body
        return
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), \
        f"{response.status_code} is not the OpenAI envelope: {response.content[:300]!r}"
    error = body["error"]
    if anthropic_route(case.path):
        # Anthropic's shape, with the type its SDK maps to an exception (a replica's error too).
        assert body["type"] == "error" and set(error) == {"type", "message"}, body
        assert error["type"] in {*ANTHROPIC_ERROR_TYPES.values(), "api_error", "invalid_request_error"}, error
        return
    assert set(error) == {"message", "type", "code", "param"}, error
    assert error["code"] in CODES or "X-Replica" in response.headers, f"undocumented code {error['code']!r}"


def retry_after_on_429_and_503(ctx: Any, response: Any, case: Any) -> None:
    if response.status_code in (429, 503):
        value = response.headers.get("Retry-After")
        value = value[0] if isinstance(value, list) else value
        assert value is not None and str(value).isdigit(), f"{response.status_code} without Retry-After"


CHECKS = [no_500_of_the_proxy, errors_are_the_envelope_with_a_documented_code, retry_after_on_429_and_503,
          status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]

def _operations() -> list[tuple[str, str, str]]:
    """(method, path, mode) of every operation: valid requests for each, invalid ones where the
    operation takes input (a body, a path or query parameter) that can be wrong."""
    doc = openapi.build()
    found = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            found.append((method.upper(), path, "positive"))
            if "requestBody" in op or "parameters" in op:
                found.append((method.upper(), path, "negative"))
    return found


@pytest.mark.parametrize(("method", "path", "mode"), _operations(), ids=lambda v: str(v))
def test_every_operation_holds_to_the_document(api: Any, method: str, path: str, mode: str) -> None:
    strategy = api[path][method].as_strategy(generation_mode=GenerationMode(mode))
    # Random model ids find only 404s: most valid requests name a configured model instead (an
    # invalid one keeps what was generated: its model may be what makes it invalid).
    models = st.sampled_from([*MODELS, None, None] if mode == "positive" else [None])

    @given(case=strategy, model=models)
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def holds(case: Any, model: str | None) -> None:
        if model is not None and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        if model is not None and "name" in (case.path_parameters or {}):
            case.path_parameters["name"] = model
        options = case.body.get("options") if isinstance(case.body, dict) else None
        if isinstance(options, dict) and isinstance(options.get("num_predict"), int) and options["num_predict"] > 64:
            # Ollama streams by default: a fuzzed num_predict of billions would stream from the sim
            # for hours, inside the proxy's timeouts. What is checked is the same at 64.
            options["num_predict"] = 64
        # A case made invalid by its headers (the admin token left out) is sent as generated: with the
        # token added back it would be valid, and its 200 no refusal of invalid data.
        header = case.meta.components.get(ParameterLocation.HEADER) if case.meta is not None else None
        negative_headers = header is not None and header.mode == GenerationMode.NEGATIVE
        case.call_and_validate(headers=None if negative_headers else AUTH, checks=CHECKS, timeout=CLIENT_TIMEOUT_S)

    holds()


def test_stateful_admin_walks_leave_a_pool_that_can_load_and_serve(api: Any, proxy: ProxyProcess) -> None:
    # The walk is over the models' admin links; the tenants' key routes (409 here: the pool has no
    # tenants) are fuzzed one by one above. Inside the walk, schemathesis' link inference between
    # minting and revoking made hypothesis draw one parameter two ways (FlakyStrategyDefinition).
    machine = api.exclude(path_regex="^/v1/admin/tenants/").as_state_machine()

    class Walk(machine):  # type: ignore[misc, valid-type]
        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any) -> None:
            case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs or None)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": AUTH, "timeout": CLIENT_TIMEOUT_S}

    def admin_actions() -> int:
        """Loads and unloads the pool has finished at an admin's word, and its replica counts."""
        total = 0
        status, _, body = http("GET", proxy.url + "/v1/admin/models", headers=AUTH)
        assert status == 200, body
        for model in body["data"]:
            total += model["loads"].get("admin", 0) + model["unloads"].get("admin", 0)
        return total

    # The walk starts from the configured pool (`loaded` loaded as configured, `cold` not), not from
    # whatever the fuzzed operations before it left: the walk is derandomized, but the links it
    # follows come from the answers, so a different start took it down paths with no valid load.
    for name, model in MODELS.items():
        status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{name}/unload", headers=AUTH)
        assert status == 200 or body["error"]["code"] == "model_not_loaded", body
        if model["enabled"]:
            status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{name}/load", {}, headers=AUTH)
            assert status == 200 and body["state"] == "loaded", body
    before = admin_actions()
    Walk.run(settings=settings(max_examples=max(3, EXAMPLES // 3), stateful_step_count=6, deadline=None,
                               derandomize=True, suppress_health_check=list(HealthCheck)))
    # The walk followed the links into real models' states (4 loads and unloads here), not only 404s.
    assert admin_actions() > before
    # No state the pool cannot leave: each model loads again with its configured settings and serves.
    for name in MODELS:
        status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{name}/unload", headers=AUTH)
        assert status == 200 or body["error"]["code"] == "model_not_loaded", body
        status, _, body = http("POST", f"{proxy.url}/v1/admin/models/{name}/load", {}, headers=AUTH)
        assert status == 200 and body["state"] == "loaded", body
        status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                               {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 200, body
