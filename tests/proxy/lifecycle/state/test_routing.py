"""Replica choice: the least loaded READY replica, by the proxy's own count and the backend's gauges."""
from __future__ import annotations

import pytest

from launchers import llama_server, sim
from helpers import ready_runtime
from proxy.config.model import ModelConfig
from proxy.upstream.engine_metrics import read_gauges
from proxy.lifecycle.state.replicas import InvalidTransition, ReplicaState
from proxy.lifecycle.state.runtime import ModelRuntime

CONFIG = ModelConfig(name="m", backend="sim", enabled=True, replicas=3, replica_max=3, target_inflight=4,
                     modalities=("text",), gpus=(), options={})


def runtime(n: int = 3) -> ModelRuntime:
    rt: ModelRuntime = ready_runtime(CONFIG, n)
    return rt


def test_capacity_is_target_inflight_times_ready_replicas() -> None:
    rt = runtime()
    assert rt.admission.capacity == 12
    rt.set_replica_state(rt.replicas[1], ReplicaState.STOPPED)
    assert rt.admission.capacity == 8


def test_least_inflight_wins() -> None:
    rt = runtime()
    rt.replicas[0].inflight, rt.replicas[1].inflight, rt.replicas[2].inflight = 3, 1, 2
    assert rt.pick_replica() is rt.replicas[1]


def test_backend_reported_backlog_counts_when_it_exceeds_ours() -> None:
    rt = runtime()
    rt.replicas[0].reported = {"running": 4.0, "waiting": 6.0}   # someone else is using replica 0
    rt.replicas[1].inflight = 2
    rt.replicas[2].inflight = 3
    assert rt.pick_replica() is rt.replicas[1]


def test_a_reading_taken_while_our_own_requests_ran_does_not_outlive_them() -> None:
    # The scrape saw the proxy's two requests running at replica 0; they have ended since. Taken
    # whole, the reading kept replica 0 looking busy until the next scrape, and it was shunned.
    rt = runtime()
    rt.replicas[0].reported, rt.replicas[0].inflight_at_scrape = {"running": 2.0}, 2
    rt.replicas[1].inflight = rt.replicas[2].inflight = 1
    assert rt.replicas[0].load()[0] == 0.0
    assert rt.pick_replica() is rt.replicas[0]
    # Beyond the proxy's own requests, the backend's count is other clients' work, and counts on top.
    rt.replicas[0].reported, rt.replicas[0].inflight = {"running": 3.0, "waiting": 1.0}, 1
    assert rt.replicas[0].load()[0] == 1.0 + 2.0


def test_kv_cache_use_breaks_ties() -> None:
    rt = runtime()
    rt.replicas[0].reported = {"kv_cache": 0.9}
    rt.replicas[1].reported = {"kv_cache": 0.2}
    rt.replicas[2].reported = {"kv_cache": 0.5}
    assert rt.pick_replica() is rt.replicas[1]


def test_idle_replicas_take_turns() -> None:
    rt = runtime()
    picked = {rt.pick_replica().index for _ in range(3)}
    assert picked == {0, 1, 2}


def test_only_ready_replicas_are_picked() -> None:
    rt = runtime()
    for r in rt.replicas[:2]:
        rt.set_replica_state(r, ReplicaState.STARTING)
    assert {rt.pick_replica().index for _ in range(4)} == {2}
    rt.set_replica_state(rt.replicas[2], ReplicaState.FAILED)
    assert rt.pick_replica() is None


def test_engine_metric_names_are_mapped_per_engine() -> None:
    vllm_text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
                 'vllm:num_requests_waiting{model_name="m",engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 1\n'
                 'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert read_gauges(vllm_text, sim.METRICS) == {"running": 3.0, "waiting": 3.0, "kv_cache": 0.25}
    llama_text = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 5\nllamacpp:n_decode_total 7\n"
    assert read_gauges(llama_text, llama_server.METRICS) == {"running": 2.0, "waiting": 5.0}


def test_a_replica_whose_host_does_not_answer_is_out_of_rotation_and_returns_only_through_starting() -> None:
    rt = runtime(2)
    capacity = rt.admission.capacity
    rt.set_replica_state(rt.replicas[0], ReplicaState.HOST_UNREACHABLE, "host a is not answering")
    assert {rt.pick_replica().index for _ in range(4)} == {1}
    assert rt.admission.capacity == capacity // 2
    with pytest.raises(InvalidTransition):   # its process ran on unseen: a health check first
        rt.set_replica_state(rt.replicas[0], ReplicaState.READY)
    rt.set_replica_state(rt.replicas[0], ReplicaState.STARTING)
    rt.set_replica_state(rt.replicas[0], ReplicaState.READY)
    assert rt.admission.capacity == capacity
