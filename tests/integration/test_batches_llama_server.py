"""The OpenAI SDK drives a batch end to end against a real llama-server over the tiny GGUF (issue
44), and a stop in the middle loses no line and runs none twice: the output file holds each
custom_id once with llama-server's own answer, and the ledger holds a row for each line run."""
from __future__ import annotations

import io
import json
import sqlite3
import time

import openai
import pytest

from helpers import ProxyProcess, http, wait_for

pytestmark = pytest.mark.integration

KEY, ADMIN_TOKEN = "sk-jobs-SECRET-4a4a", "admin-SECRET-5b5b"
LINES = 24


def test_a_batch_on_llama_server_survives_a_stop_in_the_middle(llama_model) -> None:
    proxy = ProxyProcess({"demo": llama_model(target_inflight=2)}).with_tenants(
        {"jobs": {"key_env": ["JOBS_KEY"], "fairness_key": "jobs"}}, {"JOBS_KEY": KEY}, ADMIN_TOKEN)
    try:
        proxy.start()
        proxy.wait_state("demo", "loaded")
        sdk = openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)
        data = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "demo", "max_tokens": 24, "temperature": 0,
                                            "messages": [{"role": "user", "content": f"Count to {i}"}]}}) + "\n"
                       for i in range(LINES))
        upload = sdk.files.create(file=("questions.jsonl", io.BytesIO(data.encode())), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 3, what="3 lines answered")
        stopping = proxy.proc
        assert stopping is not None
        proxy.stop()   # SIGTERM: the lines in flight end and are kept, the rest wait for the next serve
        assert stopping.returncode == 0
        assert 3 <= _done_on_disk(proxy, batch.id) < LINES   # stopped in the middle
        proxy.start()
        proxy.wait_state("demo", "loaded")
        done = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b, timeout=300,
                        what="the batch to complete after the restart")
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        out = [json.loads(line) for line in sdk.files.content(done.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(LINES)]   # each once, in order
        for o in out:
            body = o["response"]["body"]
            assert o["response"]["status_code"] == 200 and body["object"] == "chat.completion"
            assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]
        status, _, usage = http("GET", proxy.url + "/v1/admin/usage?group_by=tenant,key_id", headers=proxy.admin_headers)
        assert status == 200, usage
        assert [(r["tenant"], r["key_id"], r["requests"]) for r in usage["data"]] == [("jobs", "batch", LINES)]
    finally:
        assert not proxy.cleanup()


def _done_on_disk(proxy: ProxyProcess, batch_id: str) -> int:
    """The lines the stopped proxy kept as answered (read from its database: no proxy answers now)."""
    with sqlite3.connect(proxy.state_dir / "batches" / "batches.sqlite3") as db:
        return int(db.execute("SELECT completed + failed FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])


def test_a_batch_loads_its_model_only_where_it_fits_beside_the_others(llama_model) -> None:
    """Two models that load on demand, room for one (max_loaded_models): with `a` loaded (idle), a
    batch for `b` waits (no eviction for a batch); once an admin unloads `a`, the batch's first line
    loads `b` and runs."""
    def on_demand() -> dict:
        return llama_model(enabled=False, load_on_demand=True, target_inflight=1)
    # min_residence_s 0: a request for `b` would evict the idle `a` at once; a batch's line must not.
    proxy = ProxyProcess({"a": on_demand(), "b": on_demand()},
                         engine={"lifecycle": {"max_loaded_models": 1, "min_residence_s": 0}})
    try:
        proxy.start()
        status, _, body = http("POST", proxy.url + "/v1/chat/completions",
                               {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert status == 200 and proxy.admin_model("a")["state"] == "loaded", body
        sdk = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
        data = "".join(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "b", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "hi"}]}}) + "\n" for i in range(3))
        upload = sdk.files.create(file=("b.jsonl", io.BytesIO(data.encode())), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        # Nothing is to happen: the runner looks twice a second, so four of its looks pass here.
        time.sleep(2)
        assert proxy.admin_model("b")["state"] == "unloaded" and proxy.admin_model("a")["state"] == "loaded"
        assert sdk.batches.retrieve(batch.id).request_counts.completed == 0
        status, _, body = http("POST", proxy.url + "/v1/admin/models/a/unload", {})
        assert status == 200, body
        done = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b, timeout=300,
                        what="the batch to load b and complete")
        assert done.request_counts.completed == 3 and proxy.admin_model("b")["state"] == "loaded"
        assert proxy.admin_model("b")["loads"] == {"on_demand": 1}
    finally:
        assert not proxy.cleanup()
