"""Swaps that keep the cache, on real `llm-pool serve` with real llama-server replicas of the tiny
GGUF and room for one model: a conversation's slot is saved when its model is evicted and restored
into the next replica, so its next turn is not prefilled again; a stale, corrupt or missing file
falls back to a prefill without the client seeing anything; the disk budget holds."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

# About 700 tokens of the tiny GGUF (about a token a character): a conversation worth keeping.
HISTORY = "We talked about the archive, its shelves and the order of its boxes. " * 10


@pytest.fixture
def gguf(tiny_gguf: Path, tmp_path: Path) -> Path:
    """A copy of the tiny GGUF of this test's own (one test changes its file)."""
    path = tmp_path / "kv.gguf"
    shutil.copyfile(tiny_gguf, path)
    return path


@pytest.fixture
def swap_pool(start_proxy: Callable[..., ProxyProcess], llama_model: Callable[..., dict[str, Any]],
              gguf: Path) -> Callable[..., ProxyProcess]:
    """Two models that load on demand, room for one: a request for one evicts the other."""
    def make(kv_store_mib: float = 64, fields: dict[str, Any] | None = None, **lifecycle: Any) -> ProxyProcess:
        model = llama_model(model_path=str(gguf), enabled=False, load_on_demand=True, llama_server_n_ctx=2048,
                            llama_server_extra_args=["--ignore-eos"], **(fields or {}))
        return start_proxy({"a": model, "b": dict(model)}, engine={"lifecycle": {
            "max_loaded_models": 1, "min_residence_s": 0, "kv_store_mib": kv_store_mib, **lifecycle}})
    return make


def test_with_lora_adapters_the_base_conversations_keep_their_cache(swap_pool: Callable[..., ProxyProcess],
                                                                  tiny_lora_gguf: Path) -> None:
    """A base request names no adapter (the server's scales are 0), so it reuses its restored slot; an
    adapter's conversation is not saved: llama-server clears a restored slot at the first request
    that names an adapter (measured), so its file would cost the swap's time and disk for nothing."""
    proxy = swap_pool(fields={"lora_adapters": {"tiny": {"path": str(tiny_lora_gguf)}}, "target_inflight": 3})
    sessions = {s: conversation(s) for s in ("one", "two", "tuned")}
    first = {s: turn(proxy, "a:tiny" if s == "tuned" else "a", s, m) for s, m in sessions.items()}
    full = {s: a["timings"]["prompt_n"] for s, a in first.items()}
    evict_a(proxy)
    assert kv(proxy)["saved"] == 2   # the base's two conversations
    for s in ("one", "two", "tuned"):
        answer = turn(proxy, "a:tiny" if s == "tuned" else "a", s, next_turn(sessions[s], first[s]))
        if s != "tuned":
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= full[s] - 1, (s, answer["usage"])
    after = kv(proxy)
    assert after["restored"]["hit"] == 2
    assert after["restore_checks"] == {"verified": 2, "unverified": 0} and after["restore_unverified"] is False


def turn(proxy: ProxyProcess, model: str, session: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    status, _, body = http("POST", proxy.url + "/v1/chat/completions", headers={"X-Session-Id": session},
                           body={"model": model, "messages": messages, "max_tokens": 4})
    assert status == 200, body
    return body


def conversation(session: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"Session {session}. {HISTORY}"},
            {"role": "user", "content": "Where were the boxes?"}]


def next_turn(messages: list[dict[str, str]], answer: dict[str, Any]) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "-"},
            {"role": "user", "content": "And then?"}]


def evict_a(proxy: ProxyProcess) -> None:
    turn(proxy, "b", "other", [{"role": "user", "content": "hi"}])
    wait_for(lambda: proxy.admin_model("a")["state"] == "unloaded", what="a evicted")


def kv(proxy: ProxyProcess, model: str = "a") -> dict[str, Any]:
    return dict(proxy.admin_model(model)["kv_store"])


def slot_files(proxy: ProxyProcess) -> list[Path]:
    return sorted((proxy.state_dir / "kv").rglob("slot-*.bin"))


def metrics(proxy: ProxyProcess) -> str:
    status, _, raw = http("GET", proxy.url + "/metrics")
    assert status == 200
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def test_a_conversation_keeps_its_cache_across_an_eviction(swap_pool: Callable[..., ProxyProcess]) -> None:
    proxy = swap_pool()
    sessions = {s: conversation(s) for s in ("one", "two")}
    first = {s: turn(proxy, "a", s, m) for s, m in sessions.items()}
    full = {s: a["timings"]["prompt_n"] for s, a in first.items()}
    assert min(full.values()) > 500, full
    evict_a(proxy)
    stored = kv(proxy)
    assert stored["stored_slots"] == 2 and stored["saved"] == 2 and stored["stored_bytes"] > 0
    assert len(slot_files(proxy)) == 2
    for s, messages in sessions.items():
        answer = turn(proxy, "a", s, next_turn(messages, first[s]))
        # Only the new turn's tokens are read: the history came back with the slot.
        assert answer["timings"]["prompt_n"] * 10 < full[s], (s, answer["timings"], full[s])
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= full[s] - 1
    after = kv(proxy)
    assert after["restored"] == {"hit": 2, "miss": 0, "stale": 0}
    # Each restore was checked by its conversation's next answer, which showed the reuse: the real
    # llama-server's restores verify, and the model keeps saving (below).
    assert after["restore_checks"] == {"verified": 2, "unverified": 0} and after["restore_unverified"] is False
    # A's files went with their restores; B's one conversation was saved as A's load evicted it.
    assert after["stored_slots"] == 0 and kv(proxy, "b")["stored_slots"] == 1
    assert len(slot_files(proxy)) == 1
    text = metrics(proxy)
    assert 'llm_pool_kv_saved_total{model="a"} 2.0' in text
    assert 'llm_pool_kv_restored_total{model="a",result="hit"} 2.0' in text
    assert 'llm_pool_kv_store_bytes{model="a"} 0.0' in text
    assert 'llm_pool_kv_restore_checks_total{model="a",result="verified"} 2.0' in text
    assert 'llm_pool_kv_restore_unverified{model="a"} 0.0' in text
    evict_a(proxy)
    assert kv(proxy)["saved"] > 2 and kv(proxy)["stored_slots"] > 0


def test_a_changed_model_file_never_restores_its_old_cache(swap_pool: Callable[..., ProxyProcess],
                                                            gguf: Path) -> None:
    proxy = swap_pool()
    messages = conversation("one")
    first = turn(proxy, "a", "one", messages)
    evict_a(proxy)
    assert kv(proxy)["stored_slots"] == 1
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))   # replaced, as it looks
    answer = turn(proxy, "a", "one", next_turn(messages, first))
    assert answer["timings"]["prompt_n"] > first["timings"]["prompt_n"]      # prefilled again, whole
    assert kv(proxy)["restored"] == {"hit": 0, "miss": 0, "stale": 1}
    assert kv(proxy)["stored_slots"] == 0 and len(slot_files(proxy)) == kv(proxy, "b")["stored_slots"]


def test_a_corrupt_or_missing_file_falls_back_to_a_prefill(swap_pool: Callable[..., ProxyProcess]) -> None:
    proxy = swap_pool()
    sessions = {s: conversation(s) for s in ("one", "two")}
    first = {s: turn(proxy, "a", s, m) for s, m in sessions.items()}
    evict_a(proxy)
    corrupt, missing = slot_files(proxy)
    corrupt.write_bytes(b"\x00garbage" * 1000)
    missing.unlink()
    for s, messages in sessions.items():
        answer = turn(proxy, "a", s, next_turn(messages, first[s]))
        assert answer["timings"]["prompt_n"] > first[s]["timings"]["prompt_n"], s
    assert kv(proxy)["restored"] == {"hit": 0, "miss": 2, "stale": 0}
    assert kv(proxy)["stored_slots"] == 0 and len(slot_files(proxy)) == kv(proxy, "b")["stored_slots"]


def test_the_disk_budget_holds(swap_pool: Callable[..., ProxyProcess]) -> None:
    proxy = swap_pool()
    first = turn(proxy, "a", "one", conversation("one"))
    evict_a(proxy)
    one_slot = kv(proxy)["stored_bytes"]
    proxy.stop()
    # Room for one such slot, not two.
    budget_mib = one_slot * 1.5 / (1 << 20)
    proxy = swap_pool(kv_store_mib=budget_mib)
    assert first
    for s in ("one", "two"):
        turn(proxy, "a", s, conversation(s))
    evict_a(proxy)
    stored = kv(proxy)
    assert stored["stored_slots"] == 1 and stored["over_budget"] == 1
    assert 0 < stored["stored_bytes"] <= budget_mib * (1 << 20)
    assert sum(p.stat().st_size for p in slot_files(proxy)) == stored["stored_bytes"]
    # Loading A again evicts B: B's slot is saved, A's restored, and the budget still holds.
    turn(proxy, "a", "one", conversation("one"))
    assert sum(p.stat().st_size for p in slot_files(proxy)) <= budget_mib * (1 << 20)
