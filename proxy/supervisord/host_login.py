"""`check-config --hosts`: log into each configured node as the proxy will, and say what answered.

A wrong password otherwise shows only once `serve` runs, as a host that refuses every call.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Mapping

from proxy.config.settings import HostSettings, Settings
from proxy.masking import shown_url
from proxy.supervisord.hosts import node_client
from proxy.supervisord.supervisor import SupervisorError, SupervisorFault, SupervisorRefused, SupervisorUnavailable


@dataclass(frozen=True)
class HostLogin:
    """What one node did when logged into: `problem` (`supervisor.hosts.NAME: ...`) unless all went
    well. Never holds the password."""

    host: HostSettings
    answered: bool
    logged_in: bool
    problem: str | None = None

    def __str__(self) -> str:
        if not self.answered:
            return f"host {self.host.name}: {shown_url(self.host.url)} did not answer"
        login = "worked" if self.logged_in else "refused"
        return f"host {self.host.name}: {shown_url(self.host.url)} answered, login as {self.host.username} {login}"


async def try_login(host: HostSettings, environ: Mapping[str, str], timeout: float) -> HostLogin:
    """Call the node's llm-pool plugin with the username and the password its `password_env` holds."""
    where = f"supervisor.hosts.{host.name}"
    client = node_client(host, environ, timeout)
    try:
        await client.call("llm_pool.getInfo")
    except SupervisorRefused:
        return HostLogin(host, True, False, f"{where}: {shown_url(host.url)} refused the login as {host.username} "
                         f"with the password in {host.password_env}; set that variable to the node's "
                         "LLM_POOL_NODE_PASSWORD (and username to its --username)")
    except SupervisorUnavailable as exc:
        return HostLogin(host, False, False, f"{where}: {exc}; is `llm-pool node` running there, with url its "
                         "--listen address?")
    except SupervisorFault as exc:
        return HostLogin(host, True, True, f"{where}: {shown_url(host.url)} is a supervisord without llm-pool's "
                         f"plugin ({exc.text}); start it with `llm-pool node`")
    except SupervisorError as exc:
        return HostLogin(host, True, False, f"{where}: {exc}")
    finally:
        await client.close()
    return HostLogin(host, True, True)


async def try_logins(settings: Settings, environ: Mapping[str, str]) -> list[HostLogin]:
    """Every configured node, at once, each within supervisor.rpc_timeout_s."""
    hosts = settings.supervisor.hosts.values()
    return list(await asyncio.gather(*(try_login(h, environ, settings.supervisor.rpc_timeout_s) for h in hosts)))
