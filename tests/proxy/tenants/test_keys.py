"""A key names its tenant by its digest; keys from variables and digests; the first tenant keeps a
key two list; nothing but the id of a key is ever kept in clear."""
from __future__ import annotations

from proxy.config.settings import TenantSettings
from proxy.tenants.keys import MINTED_PREFIX, Keys, digest, key_id, may_use, new_key


def tenant(name: str, **fields: object) -> TenantSettings:
    return TenantSettings(name=name, fairness_key=name, **fields)  # type: ignore[arg-type]


def test_keys_from_variables_and_digests_name_their_tenant() -> None:
    tenants = {"a": tenant("a", key_env=("A_KEY", "UNSET")), "b": tenant("b", key_sha256=(digest("kb"),))}
    keys = Keys.configured(tenants, {"A_KEY": "ka"})
    assert keys.identify("ka") is not None and keys.identify("ka").tenant.name == "a"  # type: ignore[union-attr]
    caller = keys.identify("kb")
    assert caller is not None and (caller.tenant.name, caller.key_id) == ("b", key_id(digest("kb")))
    assert keys.identify("") is None and keys.identify("kc") is None
    keys.remove(digest("ka"))
    assert keys.identify("ka") is None


def test_a_key_listed_by_two_tenants_stays_the_first_ones() -> None:
    tenants = {"a": tenant("a", key_env=("K",)), "b": tenant("b", key_env=("K",))}
    caller = Keys.configured(tenants, {"K": "shared"}).identify("shared")
    assert caller is not None and caller.tenant.name == "a"


def test_minted_keys_are_long_random_and_say_what_they_are() -> None:
    one, two = new_key(), new_key()
    assert one != two and one.startswith(MINTED_PREFIX) and len(one) > 40
    assert len(key_id(digest(one))) == 12 and key_id(digest(one)) not in one


def test_a_tenants_globs_decide_its_models() -> None:
    assert may_use(tenant("a", models=("sim-*", "exact")), "sim-a")
    assert may_use(tenant("a", models=("sim-*", "exact")), "exact")
    assert not may_use(tenant("a", models=("sim-*",)), "private")
    assert may_use(tenant("a"), "anything")   # the default is every model


def test_a_key_from_a_variable_is_named_by_its_id_while_it_is_its_tenants() -> None:
    tenants = {"a": tenant("a", key_env=("A_KEY", "UNSET", "SHARED")), "b": tenant("b", key_env=("SHARED",))}
    keys = Keys.configured(tenants, {"A_KEY": "ka", "SHARED": "ks"})
    assert keys.env_key_id("a", "A_KEY") == key_id(digest("ka"))
    assert keys.env_key_id("a", "UNSET") is None                   # no key in it
    assert keys.env_key_id("a", "SHARED") == key_id(digest("ks"))
    assert keys.env_key_id("b", "SHARED") is None                  # a's key, not b's
    keys.remove(digest("ka"))                                      # as the admin token's is
    assert keys.env_key_id("a", "A_KEY") is None
