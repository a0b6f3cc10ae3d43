"""What a llama-server replica on the CPU is charged, measured against what it really holds (issue
29: the demo model was estimated at 1.5 MiB and measured 14, so its first load was admitted by a
tenth of its size). Real `llm-pool serve`, supervisord and llama-server with the tiny GGUF in the
shipped demo's settings (2,048 tokens, 4 slots)."""
from __future__ import annotations

from typing import Any, Callable

import pytest

from helpers import ProxyProcess, http

pytestmark = pytest.mark.integration


def test_the_estimate_of_a_llama_server_on_the_cpu_covers_what_it_was_measured_to_hold(
        start_proxy: Callable[..., ProxyProcess], llama_model: Callable[..., dict[str, Any]]) -> None:
    demo = llama_model(llama_server_n_ctx=2048, target_inflight=4, llama_server_n_gpu_layers=0)
    proxy = start_proxy({"demo": demo}, engine={"lifecycle": {"memory": {"cpu_budget_mib": 1000}}})
    proxy.wait_replicas_ready("demo", 1)
    # No history yet: admitted by the estimate, and charged at least that while it runs. The charge is
    # fixed when the model is first counted, and the monitor may have measured the running replica
    # by then (on a busy machine it often has: 23.6 against 23.5), which can only raise it.
    loaded = proxy.admin_model("demo")["footprint"]
    charged = loaded["charged_mib_per_replica"]
    assert set(charged) == {"cpu"} and charged["cpu"] >= loaded["estimated_mib_per_replica"], loaded
    status, _, _ = http("POST", proxy.url + "/v1/chat/completions",
                        body={"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert status == 200
    assert http("POST", proxy.url + "/v1/admin/models/demo/unload")[0] == 200   # measured again, after use
    footprint = proxy.admin_model("demo")["footprint"]
    measured = footprint["measured_mib_per_replica"]["cpu"]
    assert footprint["measured_samples"] >= 2 and measured > 5
    # What a first load is admitted by is within the footprint margin of what it then held.
    assert footprint["estimated_mib_per_replica"] >= 0.9 * measured, footprint
    assert footprint["charged_mib_per_replica"] is None          # unloaded: it holds nothing now
