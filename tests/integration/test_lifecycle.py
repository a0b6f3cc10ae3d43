"""Lifecycle under faults, with real supervisord and real replica processes: unload always
finishes, ports come back, orphans of a dead supervisord are stopped, secrets stay with the proxy."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import urllib.request
from typing import Any

import pytest
import yaml

from helpers import ProxyProcess, free_port_range, http, wait_for

pytestmark = pytest.mark.integration


def sim_model(**fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "target_inflight": 2, "enabled": True,
            "sim": {"max_seqs": 2, "decode_tokens_per_s": 200, "ttft_ms": 1}, **fields}


def start(proxies: list[ProxyProcess], models: dict[str, Any], ports: list[int] | None = None,
          **service: Any) -> ProxyProcess:
    proxy = ProxyProcess(models, service=service)
    if ports is not None:
        proxy.config["supervisor"]["port_range"] = ports
        proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    proxies.append(proxy)
    return proxy.start()


def chat(proxy: ProxyProcess, model: str = "sim", **fields: Any) -> tuple[int, Any]:
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                            **fields})
    return status, body


def test_unload_and_load_again_on_a_one_port_range(proxies) -> None:
    port = free_port_range(1)[0]
    proxy = start(proxies, {"sim": sim_model()}, ports=[port, port])
    for _ in range(2):
        model = proxy.wait_state("sim", "loaded")
        assert model["replicas"][0]["port"] == port
        # Requests and health probes leave connections that the replica's exit puts in TIME_WAIT.
        assert chat(proxy)[0] == 200
        status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/unload")
        assert (status, body["state"]) == (200, "unloaded")
        status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load")
        assert status == 200, body


def _stream_until_killed(proxy: ProxyProcess, started: threading.Event) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000, "stream": True}
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.readline()
            started.set()
            while resp.readline():
                pass
    except OSError:
        pass
    finally:
        started.set()


def test_unload_while_a_replica_crashes_mid_stream_ends_unloaded(proxies) -> None:
    proxy = start(proxies, {"sim": sim_model()}, drain_timeout_s=60)
    model = proxy.wait_state("sim", "loaded")
    pid = model["replicas"][0]["pid"]
    started = threading.Event()
    stream = threading.Thread(target=_stream_until_killed, args=(proxy, started))
    stream.start()
    assert started.wait(60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        unload = pool.submit(http, "POST", proxy.url + "/v1/admin/models/sim/unload")
        wait_for(lambda: proxy.admin_model("sim")["state"] == "unloading", what="the unload to start draining")
        os.kill(pid, signal.SIGKILL)     # the replica crashes mid-stream; supervisord restarts it
        status, _, body = unload.result(120)
    stream.join(60)
    assert (status, body.get("state")) == (200, "unloaded"), (body, proxy.log_path.read_text()[-3000:])
    assert not proxy.supervisorctl("status").stdout.strip()   # no program left running
    status, _, body = http("POST", proxy.url + "/v1/admin/models/sim/load")
    assert (status, body["state"]) == (200, "loaded"), body


def test_an_unload_whose_client_leaves_still_finishes(proxies) -> None:
    proxy = start(proxies, {"sim": sim_model()}, drain_timeout_s=3)
    proxy.wait_state("sim", "loaded")
    started = threading.Event()
    stream = threading.Thread(target=_stream_until_killed, args=(proxy, started))
    stream.start()
    assert started.wait(60)
    # The drain waits for the stream; the admin's client gives up long before.
    req = urllib.request.Request(proxy.url + "/v1/admin/models/sim/unload", data=b"", method="POST")
    with pytest.raises(OSError):
        urllib.request.urlopen(req, timeout=0.5)
    model = proxy.wait_state("sim", "unloaded")
    assert model["replicas"] == [] and not proxy.supervisorctl("status").stdout.strip()
    stream.join(60)
