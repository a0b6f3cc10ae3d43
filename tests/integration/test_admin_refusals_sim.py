"""A refused admin action changes nothing: the model keeps its state, replicas, last error and an
open queue, and serves on. Real `llm-pool serve` and supervisord with the simulated engine; each
refusal is answered over HTTP, then requests are sent to the model it was about."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

DUO = {"backend": "sim", "enabled": True, "replicas": 2, "replica_max": 2}
OPEN = {"open": True, "code": None, "reason": None}


def ask(proxy: ProxyProcess, model: str) -> int:
    return http("POST", proxy.url + "/v1/chat/completions",
                body={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})[0]


def kept(model: dict[str, Any]) -> tuple[Any, ...]:
    """What a refused action must leave as it was."""
    return (model["state"], [(r["index"], r["pid"], r["state"]) for r in model["replicas"]], model["last_error"],
            model["overrides"])


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    thread.start()
    return thread, result


def test_a_load_refused_409_because_it_is_loaded_with_other_settings_leaves_it_serving(start_proxy) -> None:
    proxy = start_proxy({"duo": DUO})
    before = proxy.wait_replicas_ready("duo", 2)
    for body in ({"overrides": {"sim": {"ttft_ms": 5}}}, {"replicas": 1}):
        status, _, answer = http("POST", proxy.url + "/v1/admin/models/duo/load", body=body)
        assert (status, answer["error"]["code"]) == (409, "model_already_loaded"), answer
    assert [ask(proxy, "duo") for _ in range(6)] == [200] * 6
    after = proxy.admin_model("duo")
    assert kept(after) == kept(before) and after["admission"] == OPEN


def test_refusals_400_and_409_of_a_load_scale_or_unload_leave_the_models_as_they_were(start_proxy) -> None:
    proxy = start_proxy({"duo": DUO, "cold": {"backend": "sim", "enabled": False}})
    before = proxy.wait_replicas_ready("duo", 2)
    for path, body, refused in (("duo/load", {"overrides": {"no_such_field": 1}}, (400, "invalid_load_request")),
                                ("duo/load", {"replicas": 3}, (400, "invalid_load_request")),
                                ("duo/scale", {"replicas": 3}, (400, "invalid_scale_request")),
                                ("cold/unload", None, (409, "model_not_loaded")),
                                ("cold/scale", {"replicas": 1}, (409, "model_not_loaded"))):
        status, _, answer = http("POST", f"{proxy.url}/v1/admin/models/{path}", body=body)
        assert (status, answer["error"]["code"]) == refused, (path, answer)
    assert [ask(proxy, "duo") for _ in range(6)] == [200] * 6
    after, cold = proxy.admin_model("duo"), proxy.admin_model("cold")
    assert kept(after) == kept(before) and after["admission"] == OPEN
    assert (cold["state"], cold["replicas"], cold["last_error"], cold["admission"]) == ("unloaded", [], None, OPEN)
    # And a load of the right kind still works on the model refused before.
    status, _, answer = http("POST", proxy.url + "/v1/admin/models/cold/load", body={})
    assert status == 200 and answer["state"] == "loaded" and ask(proxy, "cold") == 200


def test_a_load_refused_503_for_want_of_room_leaves_the_requests_queued_for_the_model_to_be_served(
        start_proxy, tmp_path: Path) -> None:
    # `held` holds the only place (max_loaded_models: 1) while it loads, until the test opens the
    # gate: its simulated engine starts only then.
    gate = tmp_path / "go"
    python = tmp_path / "held-python"
    python.write_text(f"#!/bin/sh\nwhile [ ! -e {gate} ]; do sleep 0.05; done\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    proxy = start_proxy({"held": {"backend": "sim", "enabled": True, "sim": {"python": str(python)}},
                         "b": {"backend": "sim", "enabled": False, "load_on_demand": True}},
                        engine={"lifecycle": {"max_loaded_models": 1}})
    proxy.wait_state("held", "loading")
    request, result = in_background(lambda: ask(proxy, "b"))
    wait_for(lambda: proxy.admin_model("b")["waiting"] == 1, what="b's request to wait for room")
    status, headers, answer = http("POST", proxy.url + "/v1/admin/models/b/load", body={})
    assert (status, answer["error"]["code"]) == (503, "insufficient_memory"), answer
    model = proxy.admin_model("b")
    assert (model["state"], model["waiting"], model["last_error"], model["admission"]) == ("unloaded", 1, None, OPEN)
    gate.touch()   # `held` loads, idle: placement evicts it for b's request
    request.join(120)
    assert result["value"] == 200
    assert proxy.admin_model("b")["loads"] == {"on_demand": 1}
