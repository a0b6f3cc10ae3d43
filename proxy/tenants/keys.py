"""Who is calling: a data-plane key, looked up by its digest, names its tenant.

Keys are kept only as SHA-256 digests (of the configured variables' values, the configured digests,
and the keys an admin minted, which the ledger stores), so a key is never held, logged or shown; a
key's id, the first characters of its digest, is what logs, metrics and the admin view name. A key
is looked up by its digest in a dict: the time taken does not depend on how much of a wrong key
matched a right one.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Iterable, Mapping

from proxy.config.settings import TenantSettings

log = logging.getLogger(__name__)

KEY_ID_LENGTH = 12
# What a minted key starts with, so that one found in a log or a repository is known for what it is.
MINTED_PREFIX = "lp-"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_id(sha256: str) -> str:
    """The short id of a key, from its digest: enough to tell keys apart, useless to guess one."""
    return sha256[:KEY_ID_LENGTH]


def new_key() -> str:
    """A fresh key, 256 bits from the system's CSPRNG."""
    return MINTED_PREFIX + secrets.token_urlsafe(32)


def may_use(tenant: TenantSettings, model: str) -> bool:
    """Whether one of the tenant's globs (`models`) matches the model id."""
    return any(fnmatchcase(model, pattern) for pattern in tenant.models)


@dataclass(frozen=True)
class Caller:
    """A request's tenant and the id of the key it came with."""

    tenant: TenantSettings
    key_id: str


class Keys:
    """Each live key's digest and the tenant it belongs to."""

    def __init__(self, tenants: Mapping[str, TenantSettings]) -> None:
        self.tenants = dict(tenants)
        self._owner: dict[str, str] = {}
        # The Caller of each live key a request presented, by the key itself: a request's lookup is
        # one dict read, no digest (a sha256 was 1% of a tenant's request's CPU). Only keys that
        # are live get in, so it holds at most one entry a key; it lives in memory only, as the key
        # did in the request, and is emptied whenever a key is added or removed.
        self._callers: dict[str, Caller] = {}
        # The digest of each (tenant, key_env variable)'s key as read at the start: the admin view
        # names such a key by its id, as it names minted and configured ones.
        self.from_env: dict[tuple[str, str], str] = {}
        # The ids of keys that are no client's (the Batch API's own, `internal`): their rows say what they are.
        self._named: dict[str, str] = {}

    @classmethod
    def configured(cls, tenants: Mapping[str, TenantSettings], environ: Mapping[str, str]) -> "Keys":
        """The keys the settings name: the values of each tenant's key_env variables (an unset or
        empty one is logged by name and skipped) and its key_sha256 digests."""
        keys = cls(tenants)
        for tenant in tenants.values():
            for var in tenant.key_env:
                value = environ.get(var, "")
                if value:
                    keys.from_env[(tenant.name, var)] = digest(value)
                    keys.add(tenant.name, keys.from_env[(tenant.name, var)])
                else:
                    log.warning("tenant %r: variable %s holds no key; its other keys still work", tenant.name, var)
            for sha in tenant.key_sha256:
                keys.add(tenant.name, sha)
        return keys

    def add(self, tenant: str, sha256: str) -> None:
        self._callers.clear()
        owner = self._owner.setdefault(sha256, tenant)
        if owner != tenant:
            # One key for two tenants would make whoever holds it either of them: the first keeps it.
            log.warning("a key (id %s) of tenant %r is configured for %r too; it stays %r's",
                        key_id(sha256), tenant, owner, owner)

    def remove(self, sha256: str) -> None:
        self._callers.clear()
        self._owner.pop(sha256, None)

    def add_all(self, minted: Iterable[tuple[str, str]]) -> None:
        """Keys minted earlier (tenant, digest), as the ledger keeps them."""
        for tenant, sha in minted:
            if tenant in self.tenants:
                self.add(tenant, sha)

    def internal(self, tenant: str, name: str) -> str:
        """A new key of `tenant` for the proxy's own requests on its behalf (a batch's lines): it
        lives in this process's memory only, and its ledger rows' key id is `name`."""
        key = new_key()
        sha = digest(key)
        self._named[sha] = name
        self.add(tenant, sha)
        return key

    def env_key_id(self, tenant: str, var: str) -> str | None:
        """The id of the key the tenant's variable `var` held at the start, while it is that tenant's
        key; None when it held none, or its key is not the tenant's (another tenant's, the admin token)."""
        sha = self.from_env.get((tenant, var))
        return key_id(sha) if sha is not None and self._owner.get(sha) == tenant else None

    def identify(self, key: str) -> Caller | None:
        caller = self._callers.get(key)
        if caller is None:
            sha = digest(key)
            owner = self._owner.get(sha)
            if owner is None:
                return None   # not kept: unknown keys must not grow the map
            caller = self._callers[key] = Caller(self.tenants[owner], self._named.get(sha) or key_id(sha))
        return caller
