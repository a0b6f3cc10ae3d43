"""With tenants, a llama-server slot's cache is a tenant's (issue 39, item 4): a request given a slot
whose cache is another tenant's, or of no known tenant, is told not to reuse it, until a request of
its own has run there; the keeper gives every generating llama-server replica such a table, an
adopted one too, and starts llama-server without its RAM prompt cache. Without tenants nothing
changes. tests/integration/test_tenant_cache_llama_server.py runs it on real llama-servers.

A LoRA adapter's cache is its own in the same way (docs/adapters.md): llama-server keeps a slot's
cache for a request that names no adapter after one that named some, so a model with adapters gets
a table too, tenants or not; test_adapters_llama_server.py shows the base's answer after the adapter's."""
from __future__ import annotations

from pathlib import Path

import aiohttp

from launchers.spec import ProgramSpec
from proxy.config.model import DEFAULT_ROUTING, Adapter, ModelConfig
from proxy.lifecycle.kvcache.keeper import NO_RAM_CACHE, KvKeeper
from proxy.lifecycle.kvcache.store import SlotStore
from proxy.lifecycle.state.replicas import Replica
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.lifecycle.state.slots import SlotTable, adapter_of, cache_scope, scope_of, scoped
from proxy.upstream.client import UpstreamHttp
from proxy.upstream.reach import ProgramReach


def test_equal_keys_of_two_tenants_are_two_keys_with_their_scopes() -> None:
    assert scoped("s:abc", "alpha") != scoped("s:abc", "beta")
    assert scope_of(scoped("s:abc", "alpha")) == "alpha" and scope_of(scoped("", "beta")) == "beta"
    assert scoped("s:abc", "") == "s:abc" and scope_of("s:abc") == ""


def test_a_slot_of_another_tenant_is_not_reused_until_a_request_of_ours_ran_there() -> None:
    table = SlotTable(1, scoped=True)
    a, b = scoped("s:x", "alpha"), scoped("s:x", "beta")
    slot, foreign = table.take(a)
    assert foreign                       # a fresh table with tenants: whose cache is it? unknown
    table.release(slot)
    assert table.take(a) == (slot, True)   # nothing ran yet (refused, or never reached the engine)
    table.ran(slot, a)
    table.release(slot)
    assert table.take(a) == (slot, False)  # alpha's cache now: alpha reuses it
    table.ran(slot, a)
    table.release(slot)
    assert table.take(b) == (slot, True)   # beta's same session is another key; alpha's cache is not for it
    table.ran(slot, a)                     # a late answer of a key that no longer holds the slot changes nothing
    table.release(slot)
    assert table.take(b) == (slot, True)


def test_a_restored_conversation_keeps_its_tenant_and_an_unkeyed_restore_is_nobodys() -> None:
    table = SlotTable(2, scoped=True)
    table.assign(scoped("c:k", "alpha"), 1)
    assert table.take(scoped("c:k", "alpha")) == (1, False)
    assert table.take(scoped("c:k", "beta")) == (0, True)


def test_without_tenants_every_slot_is_of_the_one_scope() -> None:
    table = SlotTable(2)
    assert table.take("s:x") == (0, False) and table.take("s:y") == (1, False)


def test_an_adapters_cache_is_of_its_own_scope_the_bases_of_another() -> None:
    assert cache_scope(None, None, adapters=False) is None   # llama-server picks the slot, as before
    assert cache_scope(None, None, adapters=True) == "" and cache_scope("alpha", None, adapters=True) == "alpha"
    assert cache_scope(None, "tiny", adapters=True) == ":tiny"
    assert cache_scope("alpha", "tiny", adapters=True) == "alpha:tiny" != cache_scope(None, "alpha:tiny", True)
    assert adapter_of(scoped("s:x", "alpha:t@1")) == "t@1" and adapter_of(scoped("s:x", "alpha")) is None
    assert adapter_of(scoped("", ":tiny")) == "tiny" and adapter_of("s:x") is None
    table = SlotTable(1)
    base, tuned = scoped("s:x", cache_scope(None, None, True)), scoped("s:x", cache_scope(None, "tiny", True))
    assert table.take(tuned) == (0, True)    # the base's (empty) scope: no cache of the adapter's
    table.ran(0, tuned)
    table.release(0)
    assert table.take(tuned) == (0, False)   # the adapter's conversation reuses its own
    table.ran(0, tuned)
    table.release(0)
    assert table.take(base) == (0, True)     # the same session of the base: computed under the adapter
    table.ran(0, base)
    table.release(0)
    assert table.take(base) == (0, False)


CONFIG = ModelConfig(name="m", backend="llama_server", enabled=True, replicas=1, replica_max=1, target_inflight=3,
                     modalities=("text",), gpus=(), options=dict(DEFAULT_ROUTING))
SPEC = ProgramSpec(program="m-0", argv=("/bin/true",), env=(("A", "1"),), host="127.0.0.1", port=1,
                   health_path="/health", models_path=None, served_model="m", start_timeout_s=5, stopwaitsecs=1)


async def test_with_tenants_every_generating_replica_has_a_scoped_table_and_no_ram_cache(tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        for scoped_, budget in ((True, 0), (True, 1 << 20), (False, 0)):
            keeper = KvKeeper(SlotStore(tmp_path / "kv", budget), UpstreamHttp(session), scoped=scoped_)
            spec = keeper.launch(CONFIG, SPEC, local=False)
            assert (NO_RAM_CACHE in spec.env) == scoped_ and ("A", "1") in spec.env
            for adopted in (False, True):
                replica = Replica(model="m", index=0, spec=spec, reach=ProgramReach(spec))
                replica.adopted = adopted
                await keeper.restore(ModelRuntime(config=CONFIG), replica, seconds=1)
                if not scoped_:
                    assert replica.slots is None   # no store, no tenants: llama-server picks, as before
                    continue
                assert replica.slots is not None and replica.slots.slots == 3
                # Whatever an adopted replica's (or a fresh one's) slots hold is nobody's known cache.
                assert all(replica.slots.take(scoped("", "alpha"))[1] for _ in range(3))
        embeddings = ModelConfig(**{**CONFIG.__dict__, "options": {**CONFIG.options, "llama_server_embeddings": True}})
        keeper = KvKeeper(SlotStore(tmp_path / "kv", 0), UpstreamHttp(session), scoped=True)
        assert NO_RAM_CACHE not in keeper.launch(embeddings, SPEC, local=True).env


async def test_a_model_with_adapters_has_a_table_and_no_ram_cache_without_tenants(tmp_path: Path) -> None:
    config = ModelConfig(**{**CONFIG.__dict__, "adapters": (Adapter("tiny", "m:tiny", "/lora.gguf"),)})
    async with aiohttp.ClientSession() as session:
        keeper = KvKeeper(SlotStore(tmp_path / "kv", 0), UpstreamHttp(session))
        spec = keeper.launch(config, SPEC, local=True)
        assert NO_RAM_CACHE in spec.env and NO_RAM_CACHE not in keeper.launch(CONFIG, SPEC, local=True).env
        for adopted in (False, True):
            replica = Replica(model="m", index=0, spec=spec, reach=ProgramReach(spec))
            replica.adopted = adopted
            await keeper.restore(ModelRuntime(config=config), replica, seconds=1)
            assert replica.slots is not None and replica.slots.slots == 3
            # An adopted replica's slots: whose cache, under which adapter, is unknown; a fresh one's are empty.
            assert replica.slots.take("s:x")[1] == adopted
