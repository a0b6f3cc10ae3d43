"""Which proxy `llm-pool ctl` talks to, and with which admin token.

The URL: `--url`; else the address the running proxy recorded in its state folder
(proxy/serve_address.py: right after `serve --port N`, and while the settings do not load); else
the settings' listeners; else DEFAULT_URL. The token: from the variable the settings'
service.admin_token_env names, else LLM_POOL_ADMIN_TOKEN; which one is said when the proxy refuses it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from proxy.config.loading import ConfigError, load_settings, service_hints
from proxy.config.settings import ServiceSettings, Settings
from proxy.serve_address import ServeAddress, address_path, read_address, url_for
from proxy.supervisord.managed import pid_alive

TOKEN_ENV = "LLM_POOL_ADMIN_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8011"


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None
    read: tuple[str, ...]       # the variables looked in for the token, in order
    token_env: str | None       # the one it came from

    def token_source(self) -> str:
        """Where the token came from, or where none was found: never the token."""
        if self.token_env is not None:
            return f"ctl sent the token from ${self.token_env}"
        return "ctl found no admin token: " + " and ".join(f"${v}" for v in self.read) + \
            (" are" if len(self.read) > 1 else " is") + " not set"


def resolve_target(args: argparse.Namespace, environ: Mapping[str, str],
                   warn: Callable[[str], None] | None = None) -> Target:
    """The proxy's admin URL and token for `args` (`--url`, `--config`); `warn` hears each fallback."""
    say = warn or (lambda text: print(f"llm-pool ctl: {text}", file=sys.stderr))
    config = getattr(args, "config", None)
    try:
        settings: Settings | None = load_settings(config)
        problem = None
    except ConfigError as exc:
        settings, problem = None, exc.problems[0]
    state_dir, token_env = (settings.service.state_dir, settings.service.admin_token_env) if settings is not None \
        else service_hints(config)
    read = tuple(dict.fromkeys(v for v in (token_env, TOKEN_ENV) if v))
    source = next((v for v in read if environ.get(v)), None)
    url = args.url or _proxy_url(settings, problem, state_dir, say)
    return Target(url, environ[source] if source is not None else None, read, source)


def _proxy_url(settings: Settings | None, problem: str | None, state_dir: Path, say: Callable[[str], None]) -> str:
    recorded = read_address(state_dir)
    if isinstance(recorded, ServeAddress) and pid_alive(recorded.pid):
        if problem is not None:
            say(f"settings unusable ({problem}); using the address the running proxy (pid {recorded.pid}) "
                f"recorded in {address_path(state_dir)}")
        return recorded.admin_url()
    why = recorded if isinstance(recorded, str) else None if recorded is None else \
        f"{address_path(state_dir)} names pid {recorded.pid}, which is not running"
    if settings is not None:
        if why is not None:
            say(f"{why}; using the settings' address")
        return settings_url(settings.service)
    say(f"settings unusable ({problem}); {why or f'no running proxy recorded in {address_path(state_dir)}'}; "
        f"trying {DEFAULT_URL}")
    return DEFAULT_URL


def settings_url(service: ServiceSettings) -> str:
    """The admin API's URL by the settings: its own listener (service.admin_host and admin_port)
    where there is one, else the public one."""
    if service.admin_port is not None:
        return url_for(service.admin_host or service.host, service.admin_port)
    return url_for(service.host, service.port)
