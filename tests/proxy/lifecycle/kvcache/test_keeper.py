"""The keeper's bounds and fallbacks at the replica's HTTP boundary, against a replica that
misbehaves (an asyncio server: what no real llama-server can be made to do on cue). The real
save-and-restore round trip is tests/integration/test_kv_store_llama_server.py's."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from launchers.spec import ProgramSpec
from proxy.config.loading import load_settings
from proxy.events import Events
from proxy.lifecycle.kvcache.keeper import KvKeeper, fingerprint
from proxy.lifecycle.kvcache.store import Saved
from proxy.lifecycle.placement.footprints import settings_key
from proxy.lifecycle.state.replicas import ModelState, Replica, ReplicaState
from proxy.lifecycle.state.runtime import runtimes_for
from proxy.lifecycle.state.slots import SlotTable, cache_scope, scoped
from proxy.upstream.client import UpstreamHttp
from proxy.upstream.reach import ProgramReach


class Replica_:
    """A llama-server's slot endpoints as scripted: `saves` maps a slot to what its save does."""

    def __init__(self) -> None:
        self.slots: list[dict[str, Any]] = [
            {"id": 0, "n_prompt_tokens": 50, "is_processing": False, "id_task": 7},
            {"id": 1, "n_prompt_tokens": 80, "is_processing": False, "id_task": 9},
            {"id": 2, "is_processing": False},                    # never used: nothing to save
        ]
        self.saves: dict[int, str] = {}
        self.restores: dict[int, Any] = {}
        self.saved: list[int] = []
        self.folder: Path | None = None
        self.hung = asyncio.Event()
        self.release = asyncio.Event()   # set at the end of a test: a hung save's handler ends

    async def get_slots(self, request: web.Request) -> web.Response:
        return web.json_response(self.slots)

    async def post_slot(self, request: web.Request) -> web.Response:
        slot = int(request.match_info["id"])
        body = await request.json()
        if request.query["action"] == "save":
            how = self.saves.get(slot, "ok")
            if how == "hang":
                self.hung.set()
                await self.release.wait()
            if how == "error":
                return web.json_response({"error": {"message": "Unable to save slot"}}, status=500)
            assert self.folder is not None
            (self.folder / body["filename"]).write_bytes(b"kv" * 100)
            self.saved.append(slot)
            tokens = next(s["n_prompt_tokens"] for s in self.slots if s["id"] == slot)
            return web.json_response({"id_slot": slot, "filename": body["filename"], "n_saved": tokens,
                                      "n_written": 200, "timings": {"save_ms": 1.0}})
        answer = self.restores.get(slot, {"n_restored": 50, "n_read": 200})
        if isinstance(answer, int):
            return web.json_response({"error": {"message": "Unable to restore slot"}}, status=answer)
        return web.Response(text=answer) if isinstance(answer, str) else web.json_response(answer)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[Any]:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "pool.yaml").write_text(json.dumps({
        "service": {"state_dir": str(tmp_path / "state")},
        "engine": {"lifecycle": {"kv_store_mib": 1},
                   "models": {"m": {"backend": "llama_server", "model_path": str(gguf), "target_inflight": 3}}}}))
    settings = load_settings(tmp_path / "pool.yaml")
    fake = Replica_()
    app = web.Application()
    app.router.add_get("/slots", fake.get_slots)
    app.router.add_post("/slots/{id}", fake.post_slot)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as session:
        keeper = KvKeeper.under(settings.service.state_dir, settings.lifecycle.kv_store_mib, UpstreamHttp(session))
        runtime = runtimes_for(settings)["m"]
        runtime.active, runtime.state = runtime.config, ModelState.LOADED
        spec = ProgramSpec(program="m-0", argv=("/bin/true", "--model", str(gguf)), env=(), host="127.0.0.1",
                           port=port, health_path="/health", models_path=None, served_model="m",
                           start_timeout_s=5, stopwaitsecs=1)
        spec = keeper.launch(runtime.config, spec, local=True)
        fake.folder = Path(spec.argv[spec.argv.index("--slot-save-path") + 1])
        replica = Replica(model="m", index=0, spec=spec, reach=ProgramReach(spec), state=ReplicaState.READY)
        replica.slots = SlotTable(3)
        replica.slots.assign("s:one", 1)
        runtime.replicas = [replica]
        yield keeper, runtime, replica, fake
    fake.release.set()
    await runner.cleanup()


async def test_the_most_recent_slots_are_saved_first_with_their_conversation(world: Any) -> None:
    keeper, runtime, replica, fake = world
    await keeper.save(runtime, seconds=30)
    assert fake.saved == [1, 0]    # task 9 before task 7; slot 2 holds nothing
    entries = {e.slot: e for e in keeper.store.entries("m")}
    assert entries[1].key == "s:one" and entries[0].key is None
    assert entries[1].tokens == 80 and entries[1].bytes == 200
    assert entries[1].fingerprint == fingerprint(settings_key(runtime.config), replica.spec)
    assert keeper.describe("m")["saved"] == 2


async def test_an_adapters_conversation_is_not_saved(world: Any) -> None:
    """llama-server clears a restored slot at the first request that names an adapter (measured):
    its file would cost the swap's time and the disk for nothing."""
    keeper, runtime, replica, fake = world
    replica.slots.assign(scoped("s:two", cache_scope(None, "tiny", adapters=True)), 0)
    await keeper.save(runtime, seconds=30)
    assert fake.saved == [1]
    assert [e.key for e in keeper.store.entries("m")] == ["s:one"]


async def test_a_save_that_would_outlast_the_bound_is_cut_short_and_leaves_no_file(world: Any) -> None:
    keeper, runtime, replica, fake = world
    fake.saves[1] = "hang"     # the first to save never answers
    await keeper.save(runtime, seconds=0.5)
    assert fake.hung.is_set()
    assert keeper.store.entries() == [] and fake.saved == []
    assert list(fake.folder.iterdir()) == []
    assert keeper.describe("m")["cut_short"] == 2   # the hung one and the one after it


async def test_a_save_the_engine_refuses_is_skipped_and_the_next_saved(world: Any) -> None:
    keeper, runtime, replica, fake = world
    fake.saves[1] = "error"
    await keeper.save(runtime, seconds=30)
    assert [e.slot for e in keeper.store.entries()] == [0]


async def test_nothing_is_saved_once_the_bound_is_spent(world: Any) -> None:
    keeper, runtime, replica, fake = world
    await keeper.save(runtime, seconds=0)
    assert fake.saved == [] and keeper.store.entries() == []


async def saved_then_restarted(world: Any) -> tuple[KvKeeper, Any, Replica, Replica_]:
    keeper, runtime, replica, fake = world
    await keeper.save(runtime, seconds=30)
    replica.slots = None
    return keeper, runtime, replica, fake


async def test_a_restore_gives_the_conversation_its_slot_back(world: Any) -> None:
    keeper, runtime, replica, fake = await saved_then_restarted(world)
    fake.restores[1] = {"n_restored": 80, "n_read": 200}
    await keeper.restore(runtime, replica, seconds=30)
    assert replica.slots is not None and replica.slots.key_of(1) == "s:one"
    assert replica.slots.take("s:one") == (1, False)
    assert keeper.describe("m")["restored"] == {"hit": 2, "miss": 0, "stale": 0}
    assert keeper.store.entries() == [] and list(fake.folder.iterdir()) == []


@pytest.mark.parametrize("answer", [400, "not json", {"n_restored": 3, "n_read": 200}, {"n_read": 1}, []])
async def test_a_restore_that_fails_or_does_not_match_is_a_miss_never_an_error(world: Any, answer: Any) -> None:
    keeper, runtime, replica, fake = await saved_then_restarted(world)
    fake.restores[1] = answer
    await keeper.restore(runtime, replica, seconds=30)
    assert keeper.describe("m")["restored"] == {"hit": 1, "miss": 1, "stale": 0}
    assert replica.slots is not None and replica.slots.key_of(1) is None   # prefilled afresh there
    assert list(fake.folder.iterdir()) == []


async def test_a_stale_fingerprint_is_never_restored(world: Any) -> None:
    keeper, runtime, replica, fake = await saved_then_restarted(world)
    gguf = Path(replica.spec.argv[replica.spec.argv.index("--model") + 1])
    await asyncio.to_thread(gguf.write_bytes, b"GGUF, another model of the same name")
    await keeper.restore(runtime, replica, seconds=30)
    assert keeper.describe("m")["restored"] == {"hit": 0, "miss": 0, "stale": 2}
    assert replica.slots is not None and replica.slots.key_of(1) is None
    assert list(fake.folder.iterdir()) == []


async def test_an_adopted_replica_is_left_to_llama_servers_own_matching(world: Any) -> None:
    keeper, runtime, replica, fake = await saved_then_restarted(world)
    replica.adopted = True
    await keeper.restore(runtime, replica, seconds=30)
    assert replica.slots is None and not replica.adopted


def test_replicas_elsewhere_and_models_without_a_cache_keep_nothing(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "pool.yaml").write_text(json.dumps({
        "service": {"state_dir": str(tmp_path / "state")},
        "engine": {"lifecycle": {"kv_store_mib": 1}, "models": {
            "m": {"backend": "llama_server", "model_path": str(tmp_path / "m.gguf")},
            "e": {"backend": "llama_server", "model_path": str(tmp_path / "m.gguf"), "llama_server_embeddings": True},
            "s": {"backend": "sim"}}}}))
    settings = load_settings(tmp_path / "pool.yaml")
    keeper = KvKeeper.under(settings.service.state_dir, 1, None)  # type: ignore[arg-type]
    assert keeper.applies(settings.models["m"])
    assert not keeper.applies(settings.models["e"]) and not keeper.applies(settings.models["s"])
    spec = ProgramSpec(program="m-0", argv=("llama-server",), env=(), host="127.0.0.1", port=1, health_path="/",
                       models_path=None, served_model="m", start_timeout_s=1, stopwaitsecs=1)
    assert keeper.launch(settings.models["m"], spec, local=False) == spec
    assert "--slot-save-path" in keeper.launch(settings.models["m"], spec, local=True).argv
    assert KvKeeper.under(tmp_path, 0, None).launch(settings.models["m"], spec, True) == spec  # type: ignore[arg-type]


async def restored_and_asked(world: Any) -> tuple[KvKeeper, Any, Replica, Replica_]:
    """Saved, restored into a new replica, and the conversation's next request in its slot again."""
    keeper, runtime, replica, fake = await saved_then_restarted(world)
    fake.restores[1] = {"n_restored": 80, "n_read": 200}
    await keeper.restore(runtime, replica, seconds=30)
    assert replica.slots.take("s:one") == (1, False)
    return keeper, runtime, replica, fake


async def test_a_restore_whose_next_answer_reused_nothing_stops_the_models_saves(world: Any) -> None:
    keeper, runtime, replica, fake = await restored_and_asked(world)
    keeper.events = Events()
    keeper.store.add(Saved(model="m", folder="f", fingerprint="x", replica=1, slot=0, key=None, file="slot-old.bin",
                           bytes=10, tokens=5, saved_at=1.0))   # another replica's, not yet restored
    keeper.checked(replica, 1, 0)
    view = keeper.describe("m")
    assert view["restore_unverified"] is True and view["restore_checks"] == {"verified": 0, "unverified": 1}
    assert view["stored_slots"] == 0          # restores that bring nothing: what is kept of it goes
    [event] = keeper.events.since()
    assert (event.kind, event.model, event.replica, event.reason) == ("kv_store", "m", 0, "restore_unverified")
    fake.saved.clear()
    await keeper.save(runtime, seconds=30)
    assert fake.saved == [] and keeper.store.entries() == []


async def test_a_restore_whose_next_answer_reused_it_is_verified_and_saves_go_on(world: Any) -> None:
    keeper, runtime, replica, fake = await restored_and_asked(world)
    keeper.checked(replica, 1, 79)
    keeper.checked(replica, 1, 0)             # a later answer there is no check: it reads its own turn
    assert keeper.describe("m")["restore_checks"] == {"verified": 1, "unverified": 0}
    await keeper.save(runtime, seconds=30)
    assert keeper.describe("m")["restore_unverified"] is False and keeper.store.entries()


async def test_once_a_restore_was_verified_a_conversation_without_reuse_is_only_counted(world: Any) -> None:
    keeper, runtime, replica, fake = await restored_and_asked(world)
    keeper.checked(replica, 1, 79)
    await keeper.save(runtime, seconds=30)
    replica.slots = None
    await keeper.restore(runtime, replica, seconds=30)
    replica.slots.take("s:one")
    keeper.checked(replica, 1, 0)             # that conversation sent another history under its key
    assert keeper.describe("m")["restore_checks"] == {"verified": 1, "unverified": 1}
    assert keeper.describe("m")["restore_unverified"] is False


async def test_an_answer_that_does_not_say_what_it_reused_decides_nothing(world: Any) -> None:
    keeper, runtime, replica, fake = await restored_and_asked(world)
    keeper.checked(replica, 1, None)
    keeper.checked(replica, 0, 0)             # a slot no restore filled
    assert keeper.describe("m")["restore_checks"] == {"verified": 0, "unverified": 0}
    assert keeper.describe("m")["restore_unverified"] is False
