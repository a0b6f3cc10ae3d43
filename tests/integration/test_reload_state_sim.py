"""What a reload keeps, with real supervisord and sim replicas: an admin's scaled count and load
overrides come back with the same processes, an override the new config refuses is dropped with a
warning naming it, a full stop keeps nothing, and a model whose settings changed rolls replica by
replica while requests flow, never with zero READY replicas."""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import yaml

from helpers import Load, ProxyProcess, http, pid_alive, pids, program_files, scale, wait_for

pytestmark = pytest.mark.integration


def sim_model(**fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "enabled": True, "replicas": 2, "replica_max": 3, "target_inflight": 2,
            "sim": {"max_seqs": 2, "decode_tokens_per_s": 200, "ttft_ms": 1}, **fields}


def reload(proxy: ProxyProcess, keep: bool = False, **model_changes: Any) -> None:
    """The proxy (started with --keep-models) exits keeping its models, as on SIGUSR1; the config
    may change; a new one starts, itself with --keep-models if `keep` (the last one of a test stops
    its models)."""
    proxy.stop()
    for name, fields in model_changes.items():
        proxy.config["engine"]["models"][name].update(fields)
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxy.start(keep_models=keep)


def events(proxy: ProxyProcess, kind: str) -> list[dict[str, Any]]:
    status, _, body = http("GET", proxy.url + f"/v1/admin/events?kind={kind}")
    assert status == 200, body
    return body["data"]


def test_a_scaled_count_is_kept_across_a_reload_and_a_full_stop_keeps_nothing(start_proxy) -> None:
    proxy = start_proxy({"duo": sim_model()}, keep_models=True)
    proxy.wait_replicas_ready("duo", 2)
    status, body, _ = scale(proxy, "duo", 1)
    assert status == 200, body
    (pid,) = pids(body)
    proxy.seen_pids.add(pid)
    reload(proxy)
    model = proxy.wait_replicas_ready("duo", 1)
    assert pids(model) == [pid] and model["replica_count"] == 1 and model["overrides"] == {"replicas": 1}
    assert len(program_files(proxy)) == 1
    # A full stop (SIGTERM without --keep-models) unloads every model, and each unload clears what was kept.
    proxy.stop()
    assert not pid_alive(pid)
    proxy.start()
    model = proxy.wait_replicas_ready("duo", 2)
    assert model["overrides"] == {} and pid not in pids(model)


def test_a_load_override_is_kept_and_the_replicas_adopted(start_proxy) -> None:
    proxy = start_proxy({"duo": sim_model(enabled=False)}, keep_models=True)
    status, _, body = http("POST", proxy.url + "/v1/admin/models/duo/load", {"overrides": {"sim": {"ttft_ms": 3}}})
    assert status == 200, body
    before = pids(body)
    proxy.seen_pids.update(before)
    reload(proxy, keep=True)
    model = proxy.wait_replicas_ready("duo", 2)
    assert model["overrides"] == {"sim": {"ttft_ms": 3}}
    assert pids(model) == before and [r["outdated"] for r in model["replicas"]] == [None, None]
    assert events(proxy, "restart") == []
    # An unload clears it: the next reload has nothing to keep.
    assert http("POST", proxy.url + "/v1/admin/models/duo/unload")[0] == 200
    proxy.stop()
    proxy.start()
    assert proxy.admin_model("duo")["state"] == "unloaded"


def test_a_kept_count_the_new_config_refuses_is_dropped_with_a_warning_naming_it(start_proxy) -> None:
    proxy = start_proxy({"duo": sim_model(replicas=1)}, keep_models=True)
    proxy.wait_replicas_ready("duo", 1)
    status, body, _ = scale(proxy, "duo", 3)
    assert status == 200, body
    proxy.seen_pids.update(pids(body))
    reload(proxy, duo={"replica_max": 2})
    model = proxy.wait_replicas_ready("duo", 1)
    assert model["overrides"] == {} and pids(model) == pids(body)[:1]
    log = proxy.log_path.read_text()
    assert "model duo: dropping the kept override replicas: replicas: must be an integer from 1 to replica_max (2)" \
        in log
    wait_for(lambda: not any(pid_alive(p) for p in pids(body)[1:]), what="the replicas past the count to stop")


class Watch:
    """Reads the admin view in a loop while a roll runs: the fewest READY replicas seen, and
    whether out-of-date replicas were seen serving."""

    def __init__(self, proxy: ProxyProcess, name: str) -> None:
        self.proxy, self.name = proxy, name
        self.fewest_ready = 99
        self.saw_outdated: set[str] = set()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stopping.is_set():
            model = self.proxy.admin_model(self.name)
            self.fewest_ready = min(self.fewest_ready, sum(r["state"] == "ready" for r in model["replicas"]))
            self.saw_outdated.update(r["outdated"] for r in model["replicas"] if r["outdated"])

    def __enter__(self) -> "Watch":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(60)


def test_a_settings_change_rolls_the_replicas_one_by_one_while_requests_flow(
        start_proxy, capsys: pytest.CaptureFixture[str]) -> None:
    proxy = start_proxy({"duo": sim_model(replica_max=2), "other": sim_model(replicas=1)},
                        keep_models=True, drain_timeout_s=30)
    before = pids(proxy.wait_replicas_ready("duo", 2))
    other = pids(proxy.wait_replicas_ready("other", 1))
    proxy.seen_pids.update(before + other)
    changed = sim_model(replica_max=2)["sim"] | {"ttft_ms": 2}
    reload(proxy, duo={"sim": changed})
    proxy.wait_replicas_ready("duo", 2)   # adopted as they run (out of date), then rolled
    started = time.time()
    with Watch(proxy, "duo") as watch, Load(proxy, "duo", max_tokens=40) as load:
        restarts = wait_for(lambda: len(found := events(proxy, "restart")) == 2 and found, what="two restarts")
        after = proxy.wait_replicas_ready("duo", 2)
        answered = load.answered()
        wait_for(lambda: load.answered() > answered, what="answers after the roll")
    assert load.failures == [], load.failures[:3]
    with capsys.disabled():
        print(f"\nroll of 2 sim replicas: {restarts[-1]['time'] - started:.2f}s from the adopted model loaded to "
              f"the last restart; {load.ok} requests answered, {len(load.failures)} failed; "
              f"fewest READY seen {watch.fewest_ready}")
    # Never zero (the unit test, test_rolling.py, pins the count: each new one READY before an old one leaves).
    assert watch.fewest_ready >= 1 and watch.saw_outdated == {"settings changed: sim.ttft_ms"}
    assert all(e["reason"] == "settings changed: sim.ttft_ms" and e["model"] == "duo" for e in restarts)
    assert restarts[0]["time"] > started   # requests were flowing as it rolled
    assert not set(pids(after)) & set(before) and [r["outdated"] for r in after["replicas"]] == [None, None]
    # A rolled replica takes the lowest index free when it starts: r2 beside the old r0, r1; then r0.
    assert sorted(r["index"] for r in after["replicas"]) == [0, 2]
    assert [f for f in program_files(proxy) if f.startswith("duo-")] == [f"{r['program']}.conf" for r in after["replicas"]]
    # The log route takes a replica by that name too.
    status, _, body = http("GET", proxy.url + "/v1/admin/models/duo/logs?replica=2")
    assert status == 200 and body["replica"] == 2 and body["program"] == after["replicas"][1]["program"]
    status, _, body = http("GET", proxy.url + "/v1/admin/models/duo/logs?replica=1")
    assert (status, body["error"]["code"]) == (400, "invalid_log_request")
    assert pids(proxy.admin_model("other")) == other   # unchanged: adopted as it was
    proxy.seen_pids.update(pids(after))
    wait_for(lambda: not any(pid_alive(p) for p in before), what="the old replicas to exit")


def test_a_replica_that_cannot_start_stops_the_roll_and_the_old_ones_serve_on(start_proxy) -> None:
    proxy = start_proxy({"duo": sim_model(replica_max=2)}, keep_models=True)
    before = pids(proxy.wait_replicas_ready("duo", 2))
    proxy.seen_pids.update(before)
    broken = sim_model()["sim"] | {"python": "/nonexistent/python3"}
    reload(proxy, duo={"sim": broken})

    def stopped() -> dict[str, Any] | None:
        model = proxy.admin_model("duo")
        return model if model["last_error"] and "rolling onto new settings stopped" in model["last_error"] else None
    model = wait_for(stopped, what="the roll to stop")
    assert pids(model) == before and all(r["state"] == "ready" and r["outdated"] for r in model["replicas"])
    (event,) = events(proxy, "restart")
    assert "did not become ready" in event["message"] and event["reason"] == "settings changed: sim.python"
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": "duo", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body
