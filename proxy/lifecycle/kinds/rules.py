"""The rules half of each kind: what a model must satisfy and what a request to it must pass, with no
supervisord, no HTTP session and no process (`KindRules`, proxy/lifecycle/state/kind.py).

`check-config` judges every model with these alone (proxy/cli.py); the runners (ProgramKind,
proxy/lifecycle/kinds/program_kind.py, and EndpointKind, remote.py) are these rules plus start, stop,
add and remove.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from launchers import launcher_for
from launchers.spec import Launcher
from proxy.errors import Forbidden
from proxy.lifecycle.kinds.provider import userinfo
from proxy.lifecycle.kinds.remote_options import RemoteOptions
from proxy.masking import shown_url

if TYPE_CHECKING:
    from proxy.config.model import ModelConfig


def launcher_of(config: ModelConfig) -> Launcher:
    launcher = launcher_for(config.backend)
    assert launcher is not None, "the program kind serves only backends with a launcher (kinds_for)"
    return launcher


class ProgramRules:
    """Models whose replicas are supervisord programs: their launcher's checks; no gate, no extra row."""

    def check(self, config: ModelConfig) -> list[str]:
        return launcher_of(config).check(config)

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        return None

    def describe(self, config: ModelConfig) -> dict[str, object]:
        return {}


def allowed(headers: Mapping[str, str], body: Mapping[str, Any]) -> bool:
    """`allow_remote: true` in the body; plain OpenAI clients may send X-Allow-Remote: true instead."""
    flag = body.get("allow_remote")
    if flag is None:
        return headers.get("X-Allow-Remote", "").strip().lower() == "true"
    return flag is True


class EndpointRules:
    """`openai_remote` models, without calling the provider: the config checks (the key's variable
    set, one kind of credentials), the `allow_remote` gate (remote calls may cost money) and the
    admin row."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def check(self, config: ModelConfig) -> list[str]:
        opts = RemoteOptions.from_config(config)
        env = opts.api_key_env
        if env and not self.environ.get(env):
            return [f"engine.models.{config.name}.remote_api_key_env: environment variable {env} is not set "
                    "(or empty) in the proxy's environment"]
        if env and userinfo(str(opts.base_url)) is not None:
            # A request carries one Authorization header: the key's Bearer or the URL's Basic.
            return [f"engine.models.{config.name}.remote_base_url: holds a user and password, and "
                    "remote_api_key_env names a key too; keep one of the two"]
        return []

    def gate(self, config: ModelConfig, headers: Mapping[str, str], body: Mapping[str, Any]) -> None:
        if not allowed(headers, body):
            raise Forbidden(f"model {config.name!r} is served by a remote provider and calls to it may cost "
                            "money: send `allow_remote: true` in the body (or the header X-Allow-Remote: true)",
                            code="remote_not_allowed", param="allow_remote")

    def describe(self, config: ModelConfig) -> dict[str, object]:
        opts = RemoteOptions.from_config(config)
        env = opts.api_key_env
        return {"remote": {"base_url": shown_url(str(opts.base_url)),
                           "model": opts.model,
                           "api_key_env": env, "api_key_set": bool(env and self.environ.get(env)),
                           "health_check": opts.health_check,
                           "file_mode": opts.file_mode}}
