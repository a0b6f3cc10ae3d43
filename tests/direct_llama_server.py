"""The pinned llama-server started directly, not through the proxy, with the argv the launcher builds
for a model as a config file gives it: for tests of what llama-server itself does with the tiny models.

Each server is stopped by its PID when the test leaves it, and checked gone.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import urllib.error
from pathlib import Path
from typing import Any, Iterator

import yaml

from helpers import free_port, http, pid_alive, wait_for
from launchers import llama_server
from proxy.config.loading import load_settings
from proxy.config.model import ModelConfig


def configured(tmp_path: Path, **fields: Any) -> ModelConfig:
    """The model as `llm-pool` reads it from a config file (the schema checks every field, strictly)."""
    path = tmp_path / "pool.yaml"
    path.write_text(yaml.safe_dump({"engine": {"models": {"m": {"backend": "llama_server", "target_inflight": 2,
                                                                **fields}}}}))
    return load_settings(path, strict=True).models["m"]


@contextlib.contextmanager
def served(model: ModelConfig, log: Path) -> Iterator[str]:
    """llama-server with the launcher's argv for `model` on a free loopback port, until healthy;
    stopped by its PID after, and checked gone."""
    assert llama_server.check(model) == []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(llama_server.argv(model, "127.0.0.1", port), stdout=out, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                return http("GET", url + "/health", timeout=5)[0] == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        wait_for(healthy, what="llama-server healthy")
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        assert not pid_alive(proc.pid)
