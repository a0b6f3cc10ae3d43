"""The events feed (GET /v1/admin/events) from a real `llm-pool serve` and supervisord with the
simulated engine: what happened is recorded where it happens, with its reason, its cause and who
asked; the route's filters and its refusals."""
from __future__ import annotations

import io
import os
import signal
from typing import Any

import pytest

from helpers import ProxyProcess, http, wait_for
from proxy import ctl
from proxy.cli import build_parser

pytestmark = pytest.mark.integration

TOKEN_ENV = "LLM_POOL_TEST_EVENTS_TOKEN"
TOKEN = "events-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def events(proxy: ProxyProcess, query: str = "", headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    status, _, body = http("GET", f"{proxy.url}/v1/admin/events{query}", headers=headers)
    assert status == 200, body
    assert body["object"] == "list" and body["last_id"] >= max((e["id"] for e in body["data"]), default=0)
    return list(body["data"])


def brief(feed: list[dict[str, Any]], *fields: str) -> list[tuple[Any, ...]]:
    return [tuple(e[f] for f in ("kind", *fields)) for e in feed]


def ask(proxy: ProxyProcess, model: str) -> int:
    return http("POST", proxy.url + "/v1/chat/completions",
                body={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})[0]


def test_an_admin_load_and_unload_and_a_refusal_are_events_with_who_asked_and_the_refusal_code(
        proxies: list[ProxyProcess]) -> None:
    proxy = ProxyProcess({"m": {"backend": "sim", "enabled": False}}, service={"admin_token_env": TOKEN_ENV})
    proxy.env[TOKEN_ENV] = TOKEN
    proxies.append(proxy)
    proxy.start()
    actor = "127.0.0.1 (with the token)"
    assert http("POST", proxy.url + "/v1/admin/models/m/load", body={}, headers=AUTH)[0] == 200
    status, _, refused = http("POST", proxy.url + "/v1/admin/models/m/scale", body={"replicas": 9}, headers=AUTH)
    assert (status, refused["error"]["code"]) == (400, "invalid_scale_request")
    assert http("POST", proxy.url + "/v1/admin/models/m/unload", body={}, headers=AUTH)[0] == 200
    assert http("POST", proxy.url + "/v1/admin/models/nope/unload", body={}, headers=AUTH)[0] == 404
    feed = events(proxy, headers=AUTH)
    assert brief(feed, "model", "reason", "cause", "actor") == [
        ("load", "m", "admin", None, actor),
        ("admin", "m", "load", None, actor),
        ("admin", "m", "scale", "invalid_scale_request", actor),
        ("unload", "m", "admin", None, actor),
        ("admin", "m", "unload", None, actor),
        ("admin", None, "unload", "model_not_found", actor),
    ]
    assert "refused: 400 invalid_scale_request" in feed[2]["message"]
    assert feed[5]["message"].startswith("unload 'nope' by 127.0.0.1")   # the caller's name, quoted
    # Polling: only what came after the last id seen; filters by model and kind.
    assert [e["id"] for e in events(proxy, f"?after={feed[3]['id']}", AUTH)] == [feed[4]["id"], feed[5]["id"]]
    assert brief(events(proxy, "?model=m&kind=load,unload", AUTH)) == [("load",), ("unload",)]
    assert [e["id"] for e in events(proxy, "?limit=2", AUTH)] == [feed[4]["id"], feed[5]["id"]]
    # `llm-pool ctl events` reads the same feed: a line per event, filtered as asked.
    out = io.StringIO()
    args = build_parser().parse_args(["ctl", "--url", proxy.url, "events", "--kind", "admin", "--model", "m"])
    assert ctl.run(args, out, {"LLM_POOL_ADMIN_TOKEN": TOKEN}) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["ID", "TIME", "KIND", "MODEL", "MESSAGE"] and len(lines) == 4
    assert f"scale m by {actor} refused: 400 invalid_scale_request" in lines[2]
    # Without the token the feed is closed like every admin route, and that refusal is no event.
    assert http("GET", proxy.url + "/v1/admin/events")[0] == 401
    assert http("POST", proxy.url + "/v1/admin/models/m/load", body={})[0] == 401
    assert len(events(proxy, headers=AUTH)) == len(feed)


BAD_QUERIES = [("?after=-1", "after"), ("?after=x", "after"), ("?limit=0", "limit"), ("?limit=1001", "limit"),
               ("?kind=load,exploded", "kind"), ("?kind=", "kind"), ("?kind=,", "kind")]


def test_a_bad_query_is_400_invalid_events_request_naming_it_and_an_unknown_model_404(start_proxy) -> None:
    proxy = start_proxy({"m": {"backend": "sim", "enabled": False}})
    for query, param in BAD_QUERIES:
        status, _, body = http("GET", f"{proxy.url}/v1/admin/events{query}")
        assert (status, body["error"]["code"], body["error"]["param"]) == (400, "invalid_events_request", param), query
    status, _, body = http("GET", f"{proxy.url}/v1/admin/events?model=nope")
    assert (status, body["error"]["code"]) == (404, "model_not_found")
    assert http("GET", f"{proxy.url}/v1/admin/events?model=m&kind=load&after=0&limit=5")[0] == 200


def test_an_eviction_says_which_model_it_made_room_for_and_the_unload_says_why(start_proxy) -> None:
    proxy = start_proxy({"a": {"backend": "sim", "enabled": True},
                         "b": {"backend": "sim", "enabled": False, "load_on_demand": True}},
                        engine={"lifecycle": {"max_loaded_models": 1}})
    proxy.wait_state("a", "loaded")
    assert ask(proxy, "b") == 200
    feed = [e for e in events(proxy) if e["kind"] in ("evict", "unload", "load")]
    assert brief(feed, "model", "reason", "cause") == [
        ("load", "a", "startup", None),
        ("evict", "a", "evicted", "b"),
        ("unload", "a", "evicted", "b"),
        ("load", "b", "on_demand", None),
    ]
    assert "evicted for b" in feed[2]["message"]


def test_a_sigkilled_replica_is_a_crash_event_once(start_proxy) -> None:
    proxy = start_proxy({"m": {"backend": "sim", "enabled": True}})
    pid = proxy.wait_replicas_ready("m", 1)["replicas"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    crashes = wait_for(lambda: events(proxy, "?kind=crash") or None, what="a crash event")
    proxy.wait_replicas_ready("m", 1)
    assert ask(proxy, "m") == 200
    assert brief(events(proxy, "?kind=crash"), "model", "replica") == [("crash", "m", 0)]
    assert f"pid {pid}" in crashes[0]["message"]


def test_a_supervisorctl_stop_start_and_restart_are_stopped_and_started_events_when_they_happen_not_crashes(
        start_proxy) -> None:
    proxy = start_proxy({"m": {"backend": "sim", "enabled": True, "replicas": 2, "replica_max": 2}})
    replica = proxy.wait_replicas_ready("m", 2)["replicas"][1]
    out = proxy.supervisorctl("stop", replica["program"])
    assert "stopped" in out.stdout, out
    # Said while it is stopped, not later: supervisord's own state says it was asked to stop.
    stopped = wait_for(lambda: events(proxy, "?kind=stopped") or None, what="a stopped event")
    assert brief(stopped, "model", "replica") == [("stopped", "m", 1)]
    assert f"(pid {replica['pid']}) was stopped in supervisord, not by the pool" in stopped[0]["message"]
    assert proxy.admin_model("m")["replicas"][1]["state"] == "stopped"
    assert ask(proxy, "m") == 200   # served by the other replica

    out = proxy.supervisorctl("start", replica["program"])
    assert "started" in out.stdout, out
    again = proxy.wait_replicas_ready("m", 2)["replicas"][1]
    assert brief(events(proxy, "?kind=stopped,started,crash,restart"), "model", "replica") == [
        ("stopped", "m", 1), ("started", "m", 1)]
    assert f"was started in supervisord (pid {again['pid']})" in events(proxy, "?kind=started")[0]["message"]
    assert again["restarts"] == 0   # a start an admin asked for, not a restart after a crash

    # A restart, however quick: seen by its states, or only by its new pid and supervisord's log.
    out = proxy.supervisorctl("restart", replica["program"])
    assert "started" in out.stdout, out
    wait_for(lambda: len(events(proxy, "?kind=started")) == 2, what="the restart's started event")
    restarted = proxy.wait_replicas_ready("m", 2)["replicas"][1]
    assert brief(events(proxy, "?kind=stopped,started,crash,restart"), "model", "replica") == [
        ("stopped", "m", 1), ("started", "m", 1)] * 2
    assert restarted["pid"] != again["pid"] and restarted["restarts"] == 0
