"""Sleep instead of stop with a real vLLM on a GPU (vllm_sleep_on_evict, issue 33): `llm-pool serve`
with two tiny vLLM models of which one may be resident at a time (max_loaded_models: 1). `a` sleeps
when `b` evicts it; the next request for `a` wakes it. Prints the cold load and the wake, each as a
request's whole latency and as the admin view's figure, and fails unless the wake reused the process.

    tests/gpu/vllm_sleep.sh [VLLM]
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import ProxyProcess, http  # noqa: E402
from tiny_hf_model import write_tiny_hf_llama  # noqa: E402

START_S = 900.0


def vllm_model(weights: Path, vllm: str, sleeps: bool) -> dict[str, Any]:
    return {"backend": "vllm_serve", "load_on_demand": True, "vllm_model": str(weights), "vllm_serve_binary": vllm,
            "vllm_dtype": "float32", "vllm_max_model_len": 512, "vllm_kv_cache_memory_bytes": 16 * 1024 * 1024,
            "vllm_gpu_memory_utilization": 0.3, "vllm_sleep_on_evict": sleeps,
            "vllm_serve_env": {"HF_HUB_OFFLINE": "1"}, "vllm_serve_start_timeout_s": START_S,
            "vllm_serve_extra_args": ["--enforce-eager"]}


def ask(proxy: ProxyProcess, model: str) -> float:
    """One chat request's latency, seconds; it must succeed."""
    started = time.monotonic()
    status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                           {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                           timeout=START_S)
    assert status == 200, (status, body)
    return time.monotonic() - started


def main() -> int:
    vllm = sys.argv[1] if len(sys.argv) > 1 else os.environ["LLM_POOL_TEST_VLLM"]
    weights = write_tiny_hf_llama(Path(tempfile.mkdtemp(prefix="lp-sleep-")) / "tiny-llama")
    proxy = ProxyProcess({"a": vllm_model(weights, vllm, sleeps=True), "b": vllm_model(weights, vllm, sleeps=False)},
                         engine={"lifecycle": {"max_loaded_models": 1,
                                               "memory": {"cpu_budget_mib": 65536, "gpu_headroom_mib": 1024}}})
    try:
        proxy.start()
        cold_s = ask(proxy, "a")
        cold_row = proxy.admin_model("a")
        pid = cold_row["replicas"][0]["pid"]
        ask(proxy, "b")                                   # evicts a: into sleep
        asleep = proxy.wait_state("a", "asleep", timeout=120)
        assert asleep["replicas"][0]["state"] == "asleep" and asleep["replicas"][0]["pid"] == pid, asleep
        memory = http("GET", proxy.url + "/v1/admin/memory")[2]
        wake_s = ask(proxy, "a")                          # wakes a, evicts b
        row = proxy.admin_model("a")
        assert row["state"] == "loaded" and row["replicas"][0]["pid"] == pid, row
        assert row["wakes"] == 1 and row["sleeps"] == 1, row
        print(f"cold load: request {cold_s:.2f}s")
        print(f"wake:      request {wake_s:.2f}s (wake {row['last_wake_s']}s), {cold_s / wake_s:.1f}x faster")
        print("memory while a was asleep:", [(d["device"], d["used_bytes"], d["models"]) for d in memory["devices"]])
        return 0
    finally:
        proxy.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
