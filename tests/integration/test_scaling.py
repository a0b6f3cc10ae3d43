"""Live scaling with real supervisord and real replica processes: replicas come and go while
requests keep flowing, the ones that stay keep their processes, a restarted proxy adopts them all,
and `llm-pool ctl scale` drives the real route."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Callable

import pytest

from helpers import REPO, Load, ProxyProcess, http, pid_alive, pids, program_files, scale, wait_for

pytestmark = pytest.mark.integration


def sim_model(**fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "enabled": True, "replicas": 1, "replica_max": 3, "target_inflight": 2,
            "sim": {"max_seqs": 2, "decode_tokens_per_s": 200, "ttft_ms": 1}, **fields}


def scale_under_load(proxy: ProxyProcess, name: str, up: int, report: Callable[[str], None]) -> None:
    """1 -> `up` -> 1 replicas while clients keep sending: nothing fails, replica 0 keeps its process."""
    first = proxy.wait_replicas_ready(name, 1)
    (pid0,) = pids(first)
    with Load(proxy, name) as load:
        status, body, took = scale(proxy, name, up)
        assert status == 200, body
        assert [r["state"] for r in body["replicas"]] == ["ready"] * up and body["replica_count"] == up
        # Admission follows the READY count (and lets in one more per request waiting for its
        # conversation's full replica: it holds no place).
        assert body["capacity"] == up * body["target_inflight"] + body["affinity_waiting"]
        assert pids(body)[0] == pid0
        report(f"{name}: scale 1->{up} (call to all READY) {took:.2f}s")
        # Each replica is a supervisord program of its own, all named after the model.
        listed = [line.split()[0] for line in proxy.supervisorctl("status").stdout.splitlines()]
        assert listed == [r["program"] for r in body["replicas"]]
        proxy.seen_pids.update(pids(body))
        before = load.answered()
        # The new replicas take requests too before we scale back down.
        wait_for(lambda: load.answered() >= before + 3 * up, what="answers after the scale up")
        removed = pids(body)[1:]
        status, body, took = scale(proxy, name, 1)
        assert status == 200, body
        report(f"{name}: scale {up}->1 (drain and stop) {took:.2f}s")
        assert pids(body) == [pid0] and body["replica_count"] == 1
        assert body["capacity"] == body["target_inflight"] + body["affinity_waiting"]
        before = load.answered()
        wait_for(lambda: load.answered() >= before + 3, what="answers after the scale down")
    assert load.failures == [], load.failures[:3]
    report(f"{name}: {load.ok} requests answered during the scale up and down, {len(load.failures)} failed")
    wait_for(lambda: not any(pid_alive(p) for p in removed), what="the removed replicas to exit")
    assert pid_alive(pid0)
    assert program_files(proxy) == [f"{body['replicas'][0]['program']}.conf"]


def test_scale_up_and_down_under_load_fails_no_request(start_proxy, capsys: pytest.CaptureFixture[str]) -> None:
    proxy = start_proxy({"sim": sim_model()}, drain_timeout_s=30)
    lines: list[str] = []
    scale_under_load(proxy, "sim", 3, lines.append)
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_scale_requests_are_checked(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model(), "off": sim_model(enabled=False)})
    proxy.wait_state("sim", "loaded")
    for bad in (4, 0, "2", True, None):
        status, body, _ = scale(proxy, "sim", bad)
        assert (status, body["error"]["code"]) == (400, "invalid_scale_request"), (bad, body)
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/scale", {"replicas": 2, "extra": 1})
    assert (status, body["error"]["code"]) == (400, "invalid_scale_request")
    status, body, _ = scale(proxy, "off", 2)
    assert (status, body["error"]["code"]) == (409, "model_not_loaded")
    status, body, _ = scale(proxy, "nope", 2)
    assert status == 404
    assert len(proxy.admin_model("sim")["replicas"]) == 1


def test_a_load_after_a_scale_agrees_with_it(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model()})
    proxy.wait_state("sim", "loaded")
    assert scale(proxy, "sim", 2)[0] == 200
    model = proxy.admin_model("sim")
    assert model["replica_count"] == 2 and model["overrides"] == {"replicas": 2}
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load", {"replicas": 2})
    assert status == 200 and pids(body) == pids(model)          # the same settings: nothing restarts
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load")
    assert (status, body["error"]["code"]) == (409, "model_already_loaded")
    assert scale(proxy, "sim", 1)[0] == 200
    assert proxy.admin_model("sim")["overrides"] == {}          # back to the configured count


def test_a_restarted_proxy_adopts_every_replica_of_a_scaled_model(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model()}, keep_models=True)
    proxy.wait_state("sim", "loaded")
    status, body, _ = scale(proxy, "sim", 3)
    assert status == 200, body
    before = pids(body)
    proxy.seen_pids.update(before)
    proxy.stop()
    assert all(pid_alive(p) for p in before)                    # --keep-models: they outlive the proxy
    proxy.start()
    model = proxy.wait_replicas_ready("sim", 3)
    assert pids(model) == before and model["replica_count"] == 3
    assert len(program_files(proxy)) == 3


def test_ctl_scale_round_trip(start_proxy) -> None:
    proxy = start_proxy({"sim": sim_model()})
    proxy.wait_state("sim", "loaded")
    env = {**os.environ, "LLM_POOL_LOCAL_SETTINGS_PATH": str(proxy.state_dir / "no-local.yaml")}

    def ctl(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy.cli", "--config", str(proxy.config_path), "ctl", *argv],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    done = ctl("scale", "sim", "2")
    assert done.returncode == 0, done.stderr
    model = proxy.admin_model("sim")
    assert [r["state"] for r in model["replicas"]] == ["ready", "ready"]
    proxy.seen_pids.update(pids(model))
    refused = ctl("scale", "sim", "9")
    assert refused.returncode == 1 and "replica_max" in refused.stderr + refused.stdout
    # An unload stops and removes every replica, scaled ones included.
    assert ctl("unload", "sim").returncode == 0
    assert program_files(proxy) == []
    wait_for(lambda: not any(pid_alive(p) for p in pids(model)), what="the replicas to exit")


def test_scale_a_llama_server_model_under_load(start_proxy, llama_model, capsys: pytest.CaptureFixture[str]) -> None:
    proxy = start_proxy({"tiny": llama_model(replicas=1, replica_max=2)}, drain_timeout_s=60)
    lines: list[str] = []
    scale_under_load(proxy, "tiny", 2, lines.append)
    with capsys.disabled():
        print("\n" + "\n".join(lines))

