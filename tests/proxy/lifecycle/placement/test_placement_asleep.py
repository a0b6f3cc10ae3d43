"""The placement rules for asleep models (vllm_sleep_on_evict; proxy/lifecycle/placement/rules.py):
pure, with the clock an argument. An asleep model holds its weights in host RAM and nothing on its
GPU; a request for it is a load of what it needs awake."""
from __future__ import annotations

from proxy.lifecycle.placement.rules import MIB, Limits, ModelView, plan, room_for

CPU, GPU = "cpu", "gpu0"
LIMITS = Limits(budgets={CPU: 100 * MIB, GPU: 100 * MIB}, swap_max_wait_s=10)
NOW = 1000.0


def loaded(name: str, gpu_mib: int = 60, **kw: object) -> ModelView:
    return ModelView(name=name, status="loaded", needs={GPU: gpu_mib * MIB}, resident_s=3600.0, **kw)  # type: ignore[arg-type]


def asleep(name: str, cpu_mib: int = 30, gpu_mib: int = 60, **kw: object) -> ModelView:
    return ModelView(name=name, status="asleep", needs={CPU: cpu_mib * MIB}, wake_needs={GPU: gpu_mib * MIB},
                     counted=False, resident_s=3600.0, **kw)  # type: ignore[arg-type]


def test_a_request_for_an_asleep_model_plans_its_wake_with_what_it_needs_awake() -> None:
    # Its 60 MiB awake do not fit beside b's 60 on the GPU: b is evicted, as for a cold load.
    decided = plan([asleep("a", waiting=1, waited_s=1.0, wants_load=True, blocked_s=1.0),
                    loaded("b", last_used=10)], LIMITS, NOW)
    assert decided.loads == [("a", ("b",))]


def test_its_own_host_ram_does_not_count_against_its_wake() -> None:
    # 90 MiB asleep on the CPU, 60 on the GPU awake: the wake needs no CPU room.
    room = room_for("a", [asleep("a", cpu_mib=90, waiting=1, wants_load=True)], LIMITS, NOW)
    assert room.fits and room.evict == ()


def test_an_asleep_model_holds_host_ram_and_is_evicted_for_it() -> None:
    cpu_load = ModelView(name="c", status="cold", needs={CPU: 80 * MIB}, waiting=1, wants_load=True)
    room = room_for("c", [asleep("a", cpu_mib=30, last_used=10), cpu_load], LIMITS, NOW)
    assert room.evict == ("a",)


def test_an_asleep_model_is_no_loaded_model_for_max_loaded_models() -> None:
    limits = Limits(budgets={GPU: 100 * MIB}, max_loaded=1)
    cold = ModelView(name="c", status="cold", needs={GPU: 10 * MIB}, waiting=1, wants_load=True)
    assert room_for("c", [asleep("a"), cold], limits, NOW).evict == ()


def test_an_asleep_model_unloads_when_idle_like_a_loaded_one() -> None:
    decided = plan([asleep("a", last_used=NOW - 100, idle_unload_s=60)], LIMITS, NOW)
    assert decided.idle_unloads == ["a"]
