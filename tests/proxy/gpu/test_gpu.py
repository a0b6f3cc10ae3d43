"""GPU memory: process trees read from /proc with real processes; NVML replaced by the FAKE pynvml
(tests/fakes.FakeNvml) because it needs an NVIDIA driver."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from fakes import FakeNvml
from proxy.config.model import ModelConfig
from proxy.setup.demo_model import write_tiny_gguf
from proxy.gpu.report import ModelSnapshot, gpu_report
from proxy.supervisord.managed import pid_alive
from proxy.gpu.proc_tree import descendants, parent_pids
from proxy.gpu.vram_estimate import MIB, Estimator

GIB = 1024 * MIB
# A parent that starts a child and prints its PID, then both wait for stdin to close.
PARENT = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
          "stdin=subprocess.PIPE); print(c.pid, flush=True); sys.stdin.read(); c.stdin.close(); c.wait()")


@pytest.fixture
def tree() -> Iterator[tuple[int, int]]:
    """A real parent process with a real child: (parent pid, child pid). Both end with the test."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    child = int(proc.stdout.readline())
    yield proc.pid, child
    proc.stdin.close()
    proc.wait(30)  # the parent waits for its child before it exits
    assert not pid_alive(child)


def config(name: str = "m", gpus: tuple[int, ...] = (), **options: Any) -> ModelConfig:
    return ModelConfig(name=name, backend="llama_server", enabled=True, replicas=1, replica_max=1,
                       target_inflight=1, modalities=("text",), gpus=gpus, options=options)


def test_descendants_include_children_of_a_real_process(tree: tuple[int, int]) -> None:
    parent, child = tree
    found = descendants(parent, parent_pids())
    assert found[0] == parent and child in found
    assert descendants(os.getpid(), parent_pids())[0] == os.getpid()


def test_memory_of_a_replicas_child_counts_for_its_model(tree: tuple[int, int], tmp_path: Path) -> None:
    parent, child = tree
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    nvml = FakeNvml([{"name": "FAKE H100", "used": 20 * GIB, "total": 80 * GIB,
                      "processes": [(child, 6 * GIB), (999_999_999, 2 * GIB)]},
                     {"used": 1 * GIB, "total": 80 * GIB, "processes": [(parent, 3 * GIB)]}])
    models = [ModelSnapshot(config(model_path=str(gguf), llama_server_n_ctx=4096), "loaded", ((0, parent),)),
              ModelSnapshot(config("idle"), "unloaded", ())]
    report = gpu_report(models, Estimator(), nvml_loader=lambda: nvml)
    assert report["available"] is True and nvml.shutdowns == 1
    assert report["gpus"][0] == {"index": 0, "name": "FAKE H100", "used_mib": 20480.0, "total_mib": 81920.0,
                                 "free_mib": 61440.0, "pids_visible": True}
    measured = report["models"]["m"]["measured"]
    assert measured["used_mib"] == 9 * 1024
    (replica,) = measured["replicas"]
    assert replica["pids"][0] == parent and child in replica["pids"]
    assert sorted((p["pid"], p["gpu"], p["used_mib"]) for p in replica["processes"]) == \
        sorted([(child, 0, 6144.0), (parent, 1, 3072.0)])
    assert report["models"]["idle"]["measured"] is None
    assert report["models"]["m"]["fits"] == {"0": True, "1": True}
    assert report["models"]["m"]["estimate"]["kv_cache_mib"] > 0


def test_pids_nvml_lists_from_another_namespace_are_unknown_not_zero(tree: tuple[int, int]) -> None:
    parent, _child = tree
    # A container: NVML reports host PIDs that do not exist here.
    nvml = FakeNvml([{"used": 30 * GIB, "total": 80 * GIB, "processes": [(999_999_998, 28 * GIB)]}])
    report = gpu_report([ModelSnapshot(config(), "loaded", ((0, parent),))], Estimator(), nvml_loader=lambda: nvml)
    assert report["gpus"][0]["pids_visible"] is False and "PID namespace" in report["gpus"][0]["note"]
    measured = report["models"]["m"]["measured"]
    assert measured["used_mib"] is None and "PID namespace" in measured["reason"]
    assert measured["replicas"][0]["used_mib"] is None


def test_an_empty_process_list_while_memory_is_used_is_unknown_not_zero(tree: tuple[int, int]) -> None:
    parent, _child = tree
    nvml = FakeNvml([{"used": 12 * GIB, "total": 80 * GIB, "processes": []}])
    report = gpu_report([ModelSnapshot(config(), "loaded", ((0, parent),))], Estimator(), nvml_loader=lambda: nvml)
    assert report["models"]["m"]["measured"]["used_mib"] is None
    # An idle GPU with nothing listed: the model really holds nothing there.
    idle = FakeNvml([{"used": 300 * MIB, "total": 80 * GIB, "processes": []}])
    report = gpu_report([ModelSnapshot(config(), "loaded", ((0, parent),))], Estimator(), nvml_loader=lambda: idle)
    assert report["models"]["m"]["measured"]["used_mib"] == 0 and report["gpus"][0]["pids_visible"] is True


def test_a_process_query_nvml_refuses_is_reported(tree: tuple[int, int]) -> None:
    parent, _child = tree
    nvml = FakeNvml([{"used": 5 * GIB, "total": 80 * GIB, "processes_error": "Not Supported"}])
    report = gpu_report([ModelSnapshot(config(), "loaded", ((0, parent),))], Estimator(), nvml_loader=lambda: nvml)
    assert "Not Supported" in report["gpus"][0]["note"] and report["models"]["m"]["measured"]["used_mib"] is None


def test_fits_uses_free_memory_of_the_models_gpus(tmp_path: Path) -> None:
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"\0" * (3 * MIB))
    nvml = FakeNvml([{"used": 8 * MIB, "total": 10 * MIB}, {"used": 0, "total": 10 * MIB},
                     {"used": 9 * MIB, "total": 10 * MIB}])
    models = [ModelSnapshot(config("one", gpus=(0, 1), model_path=str(weights)), "unloaded", ()),
              ModelSnapshot(config("any", model_path=str(weights)), "unloaded", ())]
    report = gpu_report(models, Estimator(), nvml_loader=lambda: nvml)
    assert report["models"]["one"]["fits"] == {"0": True, "1": True}   # 1.5 MiB on each of its two GPUs
    assert report["models"]["any"]["fits"] == {"0": False, "1": True, "2": False}


def test_without_nvml_estimates_are_still_given(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")

    def no_nvml() -> Any:
        raise ImportError("No module named 'pynvml'")

    report = gpu_report([ModelSnapshot(config(model_path=str(gguf), llama_server_n_ctx=1024), "unloaded", ())],
                        Estimator(), nvml_loader=no_nvml)
    assert report["available"] is False and "pynvml" in report["reason"]
    assert report["gpus"] == [] and report["models"]["m"]["fits"] is None
    assert report["models"]["m"]["estimate"]["weights_mib"] == round(gguf.stat().st_size / MIB, 1)
