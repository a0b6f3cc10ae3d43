"""What the `openai_remote` kind reads from a model's settings and the proxy's environment: every
`remote_*` field once (RemoteOptions), the API key as a `Secret`, and what such a backend can do.

Pure: no I/O, no HTTP client. The provider's side (proxy/lifecycle/kinds/provider.py), its Files API
(remote_files.py), the kind's rules and its runner (remote.py) all read these attributes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from launchers.options import Options, setting
from proxy.capabilities import Traits
from proxy.masking import MASK, masked

# What a remote provider can do (proxy/capabilities.py reads it): chat with multi-turn messages, the
# provider's own thinking switch, the seed's decoding mapping (temperature, top_p, max_tokens and
# stop), and file items where `remote_file_mode` says how.
TRAITS = Traits(multi_turn=True, thinking="provider", decoding_only=("max_tokens", "temperature", "top_p"),
                file_inputs_field="remote_file_mode", model_field="remote_model", remote=True, usage_on_request=True)


class Secret:
    """A value that never shows itself: str() and repr() are masked."""

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        """`text` with the value, and any part of it of MIN_PART characters or more, masked."""
        return masked(text, (self._value,))

    def __repr__(self) -> str:
        return f"Secret({MASK})"

    __str__ = __repr__


@dataclass(frozen=True)
class RemoteOptions(Options):
    """Every `remote_*` field of a model (conf/schema.json), read once."""

    PREFIX = "remote_"

    api_kind: str | None = None
    # As written: it may hold a user and password (Basic auth), so it is left out of the repr; every
    # URL shown is made from it by proxy.masking.shown_url.
    base_url: str | None = setting(repr=False)
    api_key_env: str | None = None      # the NAME of the variable holding the key, never the key
    model: str | None = None            # the provider's name of the model
    timeout_s: float = setting(120.0, convert=float)
    health_check: str = "config_only"
    max_retries: int = setting(0, convert=int)
    thinking: str | None = None
    prompt_cache_key_enabled: bool = setting(False, convert=bool)
    file_mode: str | None = None
    file_purpose: str | None = None

    def key(self, environ: Mapping[str, str]) -> Secret | None:
        """The API key from the variable api_key_env names; None without one (or with it unset or empty)."""
        env = self.api_key_env
        return Secret(environ[env]) if env and environ.get(env) else None
