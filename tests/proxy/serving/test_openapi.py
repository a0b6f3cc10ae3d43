"""GET /openapi.json: a valid OpenAPI 3.1 document that describes every route the app has, built
from the schemas the code validates with (so that it cannot drift from them)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from openapi_spec_validator import validate

from launchers import LAUNCHERS
from proxy.config.checks import override_rule
from proxy.config.files import SCHEMA_PATH
from proxy.config.loading import load_settings
from proxy.config.settings import Settings
from proxy.errors import CODES, BadRequest
from proxy.upstream.reach import PROXY_ONLY_FIELDS
from proxy.serving import openapi
from proxy.serving.app import create_app
from proxy.edge.anthropic import check_request
from proxy.serving.body import REQUIRED
from proxy.serving.keys import SETTINGS
from proxy.serving.responses import REQUEST_SCHEMA


def _settings(tmp_path: Path) -> Settings:
    doc = {"service": {"state_dir": str(tmp_path / "state")},
           "engine": {"models": {"alpha": {"backend": "sim"}, "beta": {"backend": "sim"}}}}
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(doc))
    return load_settings(tmp_path / "pool.yaml")


def _ops(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


def test_the_document_is_valid_openapi_3_1(tmp_path: Path) -> None:
    doc = openapi.build(_settings(tmp_path))
    assert doc["openapi"].startswith("3.1")
    validate(doc)   # raises on an invalid document


def test_every_route_of_the_app_is_documented_and_nothing_else(tmp_path: Path) -> None:
    app = create_app(_settings(tmp_path))   # not started: the routes are there before the pool is
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"}
    documented = _ops(openapi.build())
    assert routes - documented == set(), "routes the document does not describe"
    assert documented - routes == set(), "the document describes routes the app does not have"


def test_an_undocumented_route_is_found(tmp_path: Path) -> None:
    """The check above can fail: a route added to the app is seen."""
    app = create_app(_settings(tmp_path))
    app.router.add_get("/v1/admin/secret", lambda request: web.Response())
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    assert ("GET", "/v1/admin/secret") in routes - _ops(openapi.build())


def _body(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    schema: dict[str, Any] = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return schema


def test_the_responses_request_is_the_schema_the_route_validates_with() -> None:
    schema = _body(openapi.build(), "post", "/v1/responses")
    assert {k: v for k, v in schema.items() if k != "description"} == REQUEST_SCHEMA


def test_pass_through_bodies_name_what_the_proxy_requires_and_reads() -> None:
    doc = openapi.build()
    for path, required in REQUIRED.items():
        schema = _body(doc, "post", path)
        assert set(schema["required"]) == {"model", *(name for name, *_ in required)}
        assert set(PROXY_ONLY_FIELDS) <= set(schema["properties"])
        assert schema["additionalProperties"] is True   # OpenAI's fields pass on to the backend


def test_the_messages_route_documents_anthropics_errors_and_what_check_request_refuses() -> None:
    doc = openapi.build()
    op = doc["paths"]["/v1/messages"]["post"]
    assert {r["content"]["application/json"]["schema"]["$ref"] for s, r in op["responses"].items() if s != "200"} \
        == {"#/components/schemas/AnthropicError"}
    assert set(_body(doc, "post", "/v1/messages")["required"]) == {"model", "messages", "max_tokens"}
    with pytest.raises(BadRequest):
        check_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})   # no max_tokens
    assert "/v1/rerank" in doc["paths"] and "/v1/messages/count_tokens" in doc["paths"]


def test_load_overrides_are_each_backends_with_the_config_schemas_rule() -> None:
    fields = json.loads(SCHEMA_PATH.read_text())["$defs"]["model"]["properties"]
    overrides = _body(openapi.build(), "post", "/v1/admin/models/{name}/load")["properties"]["overrides"]
    assert overrides["x-overrides-by-backend"] == {b: list(m.LOAD_OVERRIDES) for b, m in LAUNCHERS.items()}
    for name, rule in overrides["properties"].items():
        assert rule == override_rule(fields[name]), name
    assert set(overrides["properties"]) == {n for m in LAUNCHERS.values() for n in m.LOAD_OVERRIDES}
    # What only the config files choose is not offered: the sim's interpreter.
    assert "python" in fields["sim"]["properties"] and "python" not in overrides["properties"]["sim"]["properties"]


def test_errors_are_the_envelope_with_the_catalogued_codes_and_retry_after_on_429_and_503() -> None:
    doc = openapi.build()
    error = doc["components"]["schemas"]["Error"]
    assert error["properties"]["error"]["properties"]["code"]["x-codes"] == CODES
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for status, response in op["responses"].items():
                if status in ("429", "503"):
                    assert response["headers"]["Retry-After"]["required"] is True, (method, path, status)
            if op.get("tags") == ["admin"]:
                assert op["security"] == [{"adminToken": []}]
                assert "401" in op["responses"], (method, path)
    assert doc["components"]["securitySchemes"]["adminToken"]["scheme"] == "bearer"


def test_model_ids_are_examples_never_rules(tmp_path: Path) -> None:
    """The configured ids help a client or fuzzer reach real models; an unknown id is still a
    valid request (answered 404), so they are not an enum."""
    doc = openapi.build(_settings(tmp_path))
    model = _body(doc, "post", "/v1/chat/completions")["properties"]["model"]
    assert model["examples"] == ["alpha", "beta"] and "enum" not in model
    (name,) = [p for p in doc["paths"]["/v1/admin/models/{name}/load"]["post"]["parameters"] if p["name"] == "name"]
    assert set(name["examples"]) == {"alpha", "beta"}


@pytest.mark.asyncio
async def test_the_route_serves_the_document(tmp_path: Path) -> None:
    app = web.Application()
    app[SETTINGS] = _settings(tmp_path)
    app.add_routes(openapi.routes)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        async with session.get(server.make_url("/openapi.json")) as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert await resp.json() == openapi.build(app[SETTINGS])
