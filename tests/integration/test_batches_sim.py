"""The OpenAI Batch API through the real proxy, supervisord and the simulated engine (issue 44,
docs/batches.md): the OpenAI SDK end to end, with one process and with two workers; a tenant's own
files and batches; each line a ledger row; cancel; a stop, a SIGKILL and a reload in the middle that
lose no line and run none twice; as many lines at once as the free slots allow."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import yaml

from helpers import REPO, ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

ENDED = ("completed", "failed", "expired", "cancelled")
A_KEY, B_KEY, ADMIN_TOKEN = "sk-a-SECRET-1f1f", "sk-b-SECRET-2e2e", "admin-SECRET-3d3d"
TENANTS = {"a": {"key_env": ["A_KEY"], "fairness_key": "a"}, "b": {"key_env": ["B_KEY"], "fairness_key": "b"}}


def sim(target_inflight: int = 4, decode: float = 400, **fields: Any) -> dict[str, Any]:
    return {"backend": "sim", "enabled": True, "target_inflight": target_inflight,
            "sim": {"max_seqs": target_inflight, "decode_tokens_per_s": decode, "ttft_ms": 1}, **fields}


def jsonl(count: int, model: str = "sim", max_tokens: int = 4, url: str = "/v1/chat/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                               "body": {"model": model, "max_tokens": max_tokens,
                                        "messages": [{"role": "user", "content": f"line {i}"}]}}) + "\n"
                   for i in range(count)).encode()


def client(proxy: ProxyProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)


def run_batch(sdk: openai.OpenAI, data: bytes) -> Any:
    upload = sdk.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    return sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")


def ended(sdk: openai.OpenAI, batch_id: str, timeout: float = 120) -> Any:
    return wait_for(lambda: (b := sdk.batches.retrieve(batch_id)).status in ENDED and b, timeout=timeout,
                    what=f"batch {batch_id} to end")


def output_ids(sdk: openai.OpenAI, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    return [json.loads(line)["custom_id"] for line in sdk.files.content(file_id).text.splitlines()]


def start(models: dict[str, Any], state_dir: Path | None = None, tenants: bool = False, **service: Any) -> ProxyProcess:
    proxy = ProxyProcess(models, service=service, state_dir=state_dir)
    if tenants:
        proxy.with_tenants(TENANTS, {"A_KEY": A_KEY, "B_KEY": B_KEY}, ADMIN_TOKEN)
    return proxy.start_loaded("sim")


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def proxy(request: pytest.FixtureRequest) -> Iterator[ProxyProcess]:
    started = start({"sim": sim()}, workers=request.param)
    yield started
    assert not started.cleanup()


def test_the_openai_sdk_runs_a_batch_end_to_end(proxy: ProxyProcess) -> None:
    sdk = client(proxy)
    lines = jsonl(30)
    # One line the pool refuses (an image at an address no model may be given): the error file's.
    bad = {"custom_id": "refused", "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": [
               {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}]}}
    upload = sdk.files.create(file=("lines.jsonl", io.BytesIO(lines + json.dumps(bad).encode() + b"\n")),
                              purpose="batch")
    assert (upload.object, upload.purpose, upload.filename, upload.bytes) == \
        ("file", "batch", "lines.jsonl", len(lines) + len(json.dumps(bad)) + 1)
    assert sdk.files.retrieve(upload.id).id == upload.id
    assert upload.id in [f.id for f in sdk.files.list().data]
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 31
    done = ended(sdk, batch.id)
    assert done.status == "completed" and done.metadata == {"job": "nightly"}
    assert (done.request_counts.completed, done.request_counts.failed) == (30, 1)
    assert done.usage is not None and done.usage.output_tokens == 30 * 4 and done.usage.input_tokens > 0
    out = [json.loads(line) for line in sdk.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(30)]   # the input's order, each once
    first = out[0]
    assert first["response"]["status_code"] == 200 and first["error"] is None
    assert first["response"]["body"]["object"] == "chat.completion"
    assert first["response"]["body"]["choices"][0]["message"]["content"]
    (err,) = [json.loads(line) for line in sdk.files.content(done.error_file_id).text.splitlines()]
    assert err["custom_id"] == "refused" and err["response"]["status_code"] == 400
    assert err["error"]["code"] == "image_url_not_allowed"
    assert sdk.batches.list(limit=5).data[0].id == batch.id
    assert sdk.files.delete(done.output_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(done.output_file_id)


def test_a_file_with_a_wrong_line_is_refused_naming_it(proxy: ProxyProcess) -> None:
    sdk = client(proxy)
    wrong = jsonl(2) + b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "sim"}}\n'
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.files.create(file=("bad.jsonl", io.BytesIO(wrong)), purpose="batch")
    assert refused.value.code == "invalid_batch_file"
    assert "line 3: body.messages is required for /v1/chat/completions" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.files.create(file=("a.jsonl", io.BytesIO(jsonl(1))), purpose="fine-tune")
    assert refused.value.code == "invalid_purpose"
    upload = sdk.files.create(file=("other.jsonl", io.BytesIO(jsonl(2, model="no-such-model"))), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    upload = sdk.files.create(file=("ok.jsonl", io.BytesIO(jsonl(2))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    assert "line 1: url /v1/chat/completions is not the batch's endpoint /v1/embeddings" in refused.value.message
    with pytest.raises(openai.BadRequestError):
        sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="1h")  # type: ignore[arg-type]


def test_cancel_ends_the_lines_in_flight_and_sends_no_other(tmp_path: Path) -> None:
    proxy = start({"sim": sim(target_inflight=2, decode=20)})   # a line of 20 tokens takes about 1 s
    try:
        sdk = client(proxy)
        batch = run_batch(sdk, jsonl(40, max_tokens=20))
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 1, what="a line done")
        cancelling = sdk.batches.cancel(batch.id)
        assert cancelling.status == "cancelling"
        done = ended(sdk, batch.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        got = output_ids(sdk, done.output_file_id)
        assert len(got) == done.request_counts.completed < 40
        assert len(set(got)) == len(got)
        with pytest.raises(openai.ConflictError):
            sdk.batches.cancel(run_and_finish(sdk).id)
    finally:
        assert not proxy.cleanup()


def run_and_finish(sdk: openai.OpenAI) -> Any:
    batch = run_batch(sdk, jsonl(2, max_tokens=1))
    return ended(sdk, batch.id)


def test_a_tenant_sees_only_its_own_and_each_line_is_a_row_of_its_ledger() -> None:
    proxy = start({"sim": sim()}, tenants=True)
    try:
        a, b = client(proxy, A_KEY), client(proxy, B_KEY)
        batch = run_batch(a, jsonl(12))
        done = ended(a, batch.id)
        assert done.request_counts.completed == 12
        for call in (lambda: b.batches.retrieve(batch.id), lambda: b.files.retrieve(done.input_file_id),
                     lambda: b.files.content(done.output_file_id), lambda: b.files.delete(done.input_file_id),
                     lambda: b.batches.cancel(batch.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert b.batches.list().data == [] and b.files.list().data == []
        with pytest.raises(openai.AuthenticationError):
            client(proxy, "sk-nobody").files.list()
        status, _, usage = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant,key_id", headers=proxy.admin_headers)
        assert status == 200, usage
        rows = {(r["tenant"], r["key_id"]): r["requests"] for r in usage["data"]}
        assert rows == {("a", "batch"): 12}
        status, _, view = http("GET", proxy.url + "/v1/admin/batches", headers=proxy.admin_headers)
        assert status == 200 and view["data"][0]["owner"] == "a" and view["data"][0]["completed"] == 12
        shown = subprocess.run([sys.executable, "-m", "proxy.cli", "ctl", "--url", proxy.url, "batches"], cwd=REPO,
                               env={**os.environ, "LLM_POOL_ADMIN_TOKEN": ADMIN_TOKEN}, capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        header, row = shown.stdout.splitlines()[:2]
        assert header.split()[:4] == ["BATCH", "TENANT", "MODEL", "STATUS"]
        assert row.split()[:5] == [batch.id, "a", "sim", "completed", "12/12"], shown.stdout
    finally:
        assert not proxy.cleanup()


def ledger_requests(proxy: ProxyProcess) -> int:
    status, _, usage = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant", headers=proxy.admin_headers)
    assert status == 200, usage
    return sum(r["requests"] for r in usage["data"])


@pytest.mark.parametrize("how", ["stop", "sigkill", "reload"])
def test_a_restart_in_the_middle_loses_no_line_and_runs_none_twice(how: str) -> None:
    """40 lines of about 0.5 s on two slots: the proxy stops (SIGTERM: the lines in flight end and are
    kept), is killed (SIGKILL: they run again) or reloads (SIGUSR1) in the middle. The output has each
    custom_id once; the ledger (a row for each line run) counts 40, but after a kill."""
    proxy = start({"sim": sim(target_inflight=2, decode=20)}, tenants=True)
    try:
        sdk = client(proxy, A_KEY)
        batch = run_batch(sdk, jsonl(40, max_tokens=10))
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 4, what="4 lines done")
        if how == "reload":
            proxy.reload()
        else:
            assert proxy.proc is not None
            if how == "sigkill":
                os.kill(proxy.proc.pid, signal.SIGKILL)
                proxy.proc.wait(30)
            else:
                proxy.stop()
            proxy.start()
            proxy.wait_state("sim", "loaded")
        done = ended(sdk, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 40
        got = output_ids(sdk, done.output_file_id)
        assert sorted(got) == sorted(f"req-{i}" for i in range(40))   # each once
        ran = ledger_requests(proxy)
        if how == "sigkill":
            # The lines in flight when it died (2 slots) ran again; and a kill loses the ledger's rows
            # of its last flush interval (proxy/tenants/ledger.py): no exact count either way.
            assert ran <= 42
        else:
            assert ran == 40
    finally:
        assert not proxy.cleanup()


def test_lines_take_the_free_slots_and_leave_one_to_the_classes_above() -> None:
    """Four slots, reserve_slots 1: three lines at a time while nothing else runs; an interactive
    request finds its slot at once and takes it, the batch makes do with the rest meanwhile."""
    proxy = start({"sim": sim(target_inflight=4, decode=20)})
    try:
        sdk = client(proxy)
        batch = run_batch(sdk, jsonl(30, max_tokens=10))
        seen: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(int(proxy.admin_model("sim")["classes"]["batch"]["running"]))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        wait_for(lambda: proxy.admin_model("sim")["classes"]["batch"]["running"] == 3, what="3 lines at once")
        status, _, answer = http("POST", proxy.url + "/v1/chat/completions",
                                 {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200, answer
        done = ended(sdk, batch.id)
        stop.set()
        watcher.join(30)
        assert done.request_counts.completed == 30
        assert max(seen) == 3   # never the reserved slot
    finally:
        assert not proxy.cleanup()


def test_the_storage_budget_refuses_an_upload_past_it() -> None:
    proxy = start({"sim": sim()}, )
    proxy.config["engine"]["batches"] = {"max_storage_bytes": 4000}
    proxy.config_path.write_text(yaml.safe_dump(proxy.config))
    try:
        proxy.stop()
        proxy.start()
        sdk = client(proxy)
        sdk.files.create(file=("a.jsonl", io.BytesIO(jsonl(10))), purpose="batch")   # about 1,400 bytes
        with pytest.raises(openai.APIStatusError) as refused:
            for _ in range(3):
                sdk.files.create(file=("b.jsonl", io.BytesIO(jsonl(10))), purpose="batch")
        assert refused.value.status_code == 413 and refused.value.code == "file_storage_full"
        files = sorted((proxy.state_dir / "batches" / "files").iterdir())
        assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    finally:
        assert not proxy.cleanup()
