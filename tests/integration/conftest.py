from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ProxyProcess


@pytest.fixture
def llama_model(tiny_gguf: Path, llama_server_bin: Path) -> Callable[..., dict[str, Any]]:
    """A llama_server model definition on the tiny GGUF; keyword arguments override fields."""
    def make(**fields: Any) -> dict[str, Any]:
        return {"backend": "llama_server", "model_path": str(tiny_gguf),
                "llama_server_binary": str(llama_server_bin), "llama_server_n_ctx": 4096,
                "target_inflight": 2, "enabled": True, **fields}
    return make


@pytest.fixture
def start_proxy(proxies: list[ProxyProcess]) -> Callable[..., ProxyProcess]:
    def start(models: dict[str, dict[str, Any]], keep_models: bool = False, engine: dict[str, Any] | None = None,
              **service: Any) -> ProxyProcess:
        proxy = ProxyProcess(models, service=service, engine=engine)
        proxies.append(proxy)
        return proxy.start(keep_models=keep_models)
    return start
