"""Lifecycle under faults, with real supervisord and real replica processes: unload always
finishes, ports come back, orphans of a dead supervisord are stopped, secrets stay with the proxy."""
from __future__ import annotations

from typing import Any

import pytest
import yaml

from helpers import ProxyProcess, free_port_range, http

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
