"""Where a model's memory counts (placement by device), its need (measured or estimated), the
budgets, the footprint history kept in the state directory, and check-config's warnings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from proxy.config.files import DEFAULT_SETTINGS
from proxy.config.loading import load_settings
from proxy.config.model import ModelConfig
from proxy.config.settings import LifecycleSettings
from proxy.gpu.footprint import GpuTotals, tree_cpu_bytes, tree_gpu_bytes
from proxy.gpu.vram_estimate import MIB, Estimator
from proxy.lifecycle.placement.footprints import Footprints, settings_key
from proxy.lifecycle.placement.memory import CPU, Memory, memory_warnings

from fakes import FakeNvml

GIB = 1024 * MIB
TWO_GPUS = GpuTotals({"gpu0": 80 * GIB, "gpu1": 80 * GIB})
NO_GPU = GpuTotals({}, "NVML unavailable: ImportError: no pynvml")


def model(backend: str = "llama_server", gpus: tuple[int, ...] = (), **options: Any) -> ModelConfig:
    return ModelConfig(name="m", backend=backend, enabled=False, replicas=options.pop("replicas", 1), replica_max=4,
                       target_inflight=1, modalities=("text",), gpus=gpus, options=options)


def memory(tmp_path: Path, gpus: GpuTotals = TWO_GPUS, **life: Any) -> Memory:
    return Memory(LifecycleSettings(**life), Footprints(tmp_path / "footprints.json"), Estimator(), gpus)


def test_a_model_counts_where_its_settings_put_it(tmp_path: Path) -> None:
    mem = memory(tmp_path)
    assert mem.placement(model(llama_server_n_gpu_layers=0)).devices == (CPU,)
    assert mem.placement(model(llama_server_n_gpu_layers=99)).devices == ("gpu0",)
    assert "unset" in mem.placement(model()).why and mem.placement(model()).devices == ("gpu0",)
    assert mem.placement(model(gpus=(0, 1), llama_server_n_gpu_layers=99)).devices == ("gpu0", "gpu1")
    assert mem.placement(model("vllm_serve")).devices == ("gpu0",)
    assert mem.placement(model("exllamav3")).devices == ("gpu0",)
    assert mem.placement(model("ct2", device="cuda")).devices == ("gpu0",)
    assert mem.placement(model("ct2")).devices == (CPU,)
    assert mem.placement(model("llama_cpp")).devices == (CPU,)
    assert mem.placement(model("sim")).devices == (CPU,)
    assert mem.placement(model("openai_remote")).devices == ()


def test_without_a_visible_gpu_every_local_model_counts_against_the_cpu(tmp_path: Path) -> None:
    placed = memory(tmp_path, NO_GPU).placement(model("vllm_serve"))
    assert placed.devices == (CPU,) and "no GPU is visible here" in placed.why and "NVML unavailable" in placed.why


def test_budgets_are_set_only_by_the_settings(tmp_path: Path) -> None:
    assert memory(tmp_path).budgets() == {}      # the defaults: no load is refused for memory
    assert memory(tmp_path, cpu_budget_mib=512, gpu_headroom_mib=1024).budgets() == {
        CPU: 512 * MIB, "gpu0": 79 * GIB, "gpu1": 79 * GIB}


def test_the_need_is_the_estimate_until_measured_then_the_measurement(tmp_path: Path, tiny_gguf: Path) -> None:
    mem = memory(tmp_path, footprint_margin=0.1)
    config = model(model_path=str(tiny_gguf), llama_server_n_ctx=4096, llama_server_n_gpu_layers=0, replicas=2)
    need = mem.need(config)
    estimate = mem.estimate(config, (CPU,)).total_bytes
    assert need.source == "estimated" and need.per_device == {CPU: 2 * estimate}
    mem.footprints.record(config, {CPU: 100 * MIB})
    need = mem.need(config)
    assert need.source == "measured" and need.per_replica == {CPU: 110 * MIB} and need.per_device == {CPU: 220 * MIB}
    row = mem.describe(config)
    assert row["admitted_by"] == "measured" and row["measured_mib_per_replica"] == {CPU: 100.0}
    assert row["estimated_mib_per_replica"] == round(estimate / MIB, 1) and row["missing_files"] == []
    gone = model(model_path=str(tmp_path / "gone.gguf"), llama_server_n_gpu_layers=0)
    assert mem.describe(gone)["missing_files"] == [f"model_path {tmp_path / 'gone.gguf'}"]


def test_a_measurement_below_the_estimate_does_not_lower_the_need(tmp_path: Path, tiny_gguf: Path) -> None:
    # Before: the measurement replaced the estimate, however low (a replica measured before use).
    mem = memory(tmp_path, footprint_margin=0.0)
    config = model(model_path=str(tiny_gguf), llama_server_n_ctx=4096, llama_server_n_gpu_layers=0)
    estimate = mem.estimate(config, (CPU,)).total_bytes
    mem.footprints.record(config, {CPU: estimate // 2})
    need = mem.need(config)
    assert need.source == "estimated" and need.per_replica == {CPU: estimate}
    assert need.detail["samples"] == 1


def test_footprints_take_a_high_percentile_per_settings_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "footprints.json"
    store = Footprints(path, percentile=90, margin=0.0)
    config = model(llama_server_n_ctx=4096)
    for mib in (10, 20, 30, 40, 50, 60, 70, 80, 90, 1000):
        store.record(config, {CPU: mib * MIB})
    assert store.measured(config, (CPU,)).per_replica == {CPU: 90 * MIB}   # type: ignore[union-attr]
    again = Footprints(path, percentile=90, margin=0.0)
    assert again.measured(config, (CPU,)).samples == 10                    # type: ignore[union-attr]
    # Other settings that change memory are another history; a replica count is not.
    assert again.measured(model(llama_server_n_ctx=8192), (CPU,)) is None
    assert again.measured(model(llama_server_n_ctx=4096, replicas=3), (CPU,)) is not None
    assert settings_key(model(llama_server_n_ctx=4096, idle_unload_s=5)) == settings_key(config)
    # Measured on the CPU, it says nothing about a GPU.
    assert again.measured(config, ("gpu0",)) is None


def test_a_corrupt_footprints_file_costs_the_history_not_the_service(tmp_path: Path) -> None:
    path = tmp_path / "footprints.json"
    path.write_text("{not json")
    store = Footprints(path)
    assert store.measured(model(), (CPU,)) is None
    store.record(model(), {CPU: MIB})
    assert Footprints(path).measured(model(), (CPU,)) is not None


def test_a_process_tree_is_measured_by_its_resident_memory_and_by_nvml() -> None:
    assert tree_cpu_bytes(os.getpid()) > 10 * MIB          # this test process, from /proc
    assert tree_cpu_bytes(999_999_999) is None
    nvml = FakeNvml([{"used": 30 * GIB, "total": 80 * GIB, "processes": [(os.getpid(), 12 * GIB), (1, 5 * GIB)]},
                     {"used": 1 * GIB, "total": 80 * GIB, "processes": [(os.getpid(), 1 * GIB)]}])
    assert tree_gpu_bytes(os.getpid(), lambda: nvml) == {"gpu0": 12 * GIB, "gpu1": 1 * GIB}


# Maps the file named by argv[1] and reads every page (as llama-server maps its GGUF), then, with
# argv[2] "fork", forks a child that maps it too; says "ready" (the child, once it has read the
# file too) and waits for its stdin to close.
MAPPER = """
import mmap, os, sys
def touch():
    f = open(sys.argv[1], "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    sum(m[i] for i in range(0, len(m), 4096))
    return m
m = touch()
child = os.fork() if sys.argv[2] == "fork" else None
if child == 0:
    m2 = touch(); print("ready", flush=True); sys.stdin.read(); os._exit(0)
if child is None:
    print("ready", flush=True)
sys.stdin.read()
if child:
    os.waitpid(child, 0)
"""


def _mapper(path: Path, fork: bool) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(path), "fork" if fork else "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _pss(pid: int) -> int:
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return next(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Pss:"))


def test_a_cpu_footprint_does_not_change_with_its_neighbours_and_counts_a_file_once(tmp_path: Path) -> None:
    # Before: PSS, which splits a page between the processes that map it, so the same model
    # measured 10.2 to 19.3 MiB as other replicas of the same GGUF came and went (issue 29).
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(32 * MIB))
    procs = [_mapper(weights, fork=False)]
    try:
        alone, alone_pss = tree_cpu_bytes(procs[0].pid), _pss(procs[0].pid)
        procs.append(_mapper(weights, fork=False))   # a neighbour maps the same file
        beside, beside_pss = tree_cpu_bytes(procs[0].pid), _pss(procs[0].pid)
        assert alone is not None and beside is not None and alone > 32 * MIB
        assert beside_pss < alone_pss - 12 * MIB     # what PSS did: half the file went to the neighbour
        assert abs(beside - alone) < 2 * MIB         # what it is now: the same figure
        # A tree whose two processes map the file holds it once.
        procs.append(_mapper(weights, fork=True))
        tree = tree_cpu_bytes(procs[2].pid)
        assert tree is not None and 32 * MIB < tree < alone + 16 * MIB
    finally:
        for proc in procs:
            proc.communicate("")   # stdin closed: parent and child end
            proc.wait(10)


def test_check_config_warns_of_a_model_that_can_never_fit(tmp_path: Path, tiny_gguf: Path) -> None:
    conf = tmp_path / "pool.yaml"
    big = {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_n_gpu_layers": 0}
    # Each is charged about 17.5 MiB (weights, the server process, the logits' buffer) plus 1.5 KiB a
    # token (KV cache and attention mask): pinned 209.5 MiB, huge 785.5, beside 113.5, fits 23.5.
    conf.write_text(f"""
service: {{state_dir: {tmp_path}}}
engine:
  lifecycle: {{memory: {{cpu_budget_mib: 300}}}}
  models:
    pinned: {{<<: *big, enabled: true, pinned: true, llama_server_n_ctx: 131072}}
    huge: {{<<: *big, llama_server_n_ctx: 524288}}
    beside: {{<<: *big, llama_server_n_ctx: 65536}}
    fits: {{<<: *big, llama_server_n_ctx: 4096}}
""".replace("*big", str(big).replace("'", "")))
    settings = load_settings(conf)
    warnings = memory_warnings(settings, nvml_loader=lambda: (_ for _ in ()).throw(ImportError("no NVML")))
    assert any(w.startswith("engine.models.huge: model_too_large") for w in warnings), warnings
    # 113.5 MiB fits the budget, not beside the pinned model's 209.5.
    assert any(w.startswith("engine.models.beside: model_too_large") for w in warnings), warnings
    assert not any("engine.models.fits" in w for w in warnings)
    assert memory_warnings(load_settings(DEFAULT_SETTINGS)) == []    # no limits set: nothing to say
