"""A shim as the process supervisord runs: `python -m shims.ct2`, its load, its SIGTERM drain, its exit."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO, free_port, http, wait_for

pytestmark = pytest.mark.integration


def start_shim(model_path: Path, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "shims.ct2", "--port", str(port), "--model", "tiny", "--model-path",
            str(model_path), "--shutdown-timeout", "20", *extra]
    return subprocess.Popen(argv, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def health(port: int) -> int:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health")[0]
    except OSError:
        return 0


def test_sigterm_finishes_the_running_request_refuses_new_ones_and_exits(tiny_ct2, tmp_path) -> None:
    port = free_port()
    proc = start_shim(tiny_ct2["decoder"], port, tmp_path / "shim.log")
    try:
        wait_for(lambda: health(port) == 200, what="the shim to load")
        body = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.readline().startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            # No new connections once draining; the running stream still ends properly.
            wait_for(lambda: health(port) == 0, what="the listener to close")
            events = [e for e in resp.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3000
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_model_that_cannot_load_exits_non_zero_with_the_reason_in_its_log(tmp_path) -> None:
    port = free_port()
    log = tmp_path / "shim.log"
    proc = start_shim(tmp_path, port, log)   # an empty folder: no model.bin
    try:
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "is not a CTranslate2 model folder" in log.read_text()
