"""`llm-pool ctl` against a small aiohttp app on port 0: request shapes, follow offsets, exit codes.
(tests/integration/test_operating.py runs it against a real proxy.)"""
from __future__ import annotations

import asyncio
import json
import io
from typing import Any, Callable

import pytest
from aiohttp import web

from helpers import free_port
from proxy import ctl
from proxy.cli import build_parser
from proxy.ctl_target import Target, resolve_target


class Upstream:
    """A stand-in admin API that records what it was sent and answers from a script."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any, str | None]] = []
        self.answers: dict[str, Callable[[web.Request], web.Response]] = {}
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.seen.append((request.method, request.path_qs, body, request.headers.get("Authorization")))
        return self.answers[request.path](request)


@pytest.fixture
async def upstream() -> Any:
    up = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    up.url = f"http://127.0.0.1:{port}"
    yield up
    await runner.cleanup()


async def run_ctl(up: Upstream, *argv: str, environ: dict[str, str] | None = None) -> tuple[int, str]:
    args = build_parser().parse_args(["ctl", "--url", up.url, *argv])
    out = io.StringIO()
    # ctl is synchronous (urllib): run it off this loop, which serves the upstream.
    code = await asyncio.to_thread(ctl.run, args, out, environ or {})
    return code, out.getvalue()


MODEL = {"id": "qwen", "backend": "llama_server", "state": "loaded", "replica_max": 4, "active": 1, "waiting": 0,
         "last_error": None, "replicas": [{"index": 0, "state": "ready", "pid": 11, "port": 18100},
                                          {"index": 1, "state": "starting", "pid": 12, "port": 18101}]}


async def test_scale_sends_the_replica_count(upstream: Upstream) -> None:
    upstream.answers["/v1/admin/models/qwen/scale"] = lambda r: web.json_response(MODEL)
    code, out = await run_ctl(upstream, "scale", "qwen", "2", environ={"LLM_POOL_ADMIN_TOKEN": "tok"})
    assert code == 0
    assert upstream.seen == [("POST", "/v1/admin/models/qwen/scale", {"replicas": 2}, "Bearer tok")]
    assert "replica 1: starting pid=12 port=18101" in out


async def test_adapter_loads_or_unloads_one_of_a_models_adapters(upstream: Upstream) -> None:
    served = {**MODEL, "replicas": [{**MODEL["replicas"][0], "adapters": ["sql"]}]}
    upstream.answers["/v1/admin/models/qwen/adapters/sql/unload"] = lambda r: web.json_response(served)
    code, out = await run_ctl(upstream, "adapter", "unload", "qwen", "sql", environ={"LLM_POOL_ADMIN_TOKEN": "tok"})
    assert code == 0
    assert upstream.seen == [("POST", "/v1/admin/models/qwen/adapters/sql/unload", None, "Bearer tok")]
    assert "adapters=sql" in out


async def test_load_sends_typed_overrides_and_replicas(upstream: Upstream) -> None:
    upstream.answers["/v1/admin/models/a b/load"] = lambda r: web.json_response(MODEL)
    code, _ = await run_ctl(upstream, "load", "a b", "--override", "llama_server_n_ctx=8192",
                            "--override", "llama_server_spec_type=draft", "--override", "sim={ttft_ms: 5}",
                            "--replicas", "2")
    assert code == 0
    method, path, body, auth = upstream.seen[0]
    assert (method, path, auth) == ("POST", "/v1/admin/models/a%20b/load", None)
    assert body == {"overrides": {"llama_server_n_ctx": 8192, "llama_server_spec_type": "draft",
                                  "sim": {"ttft_ms": 5}}, "replicas": 2}


async def test_models_table_and_json(upstream: Upstream) -> None:
    upstream.answers["/v1/admin/models"] = lambda r: web.json_response({"object": "list", "data": [MODEL]})
    code, out = await run_ctl(upstream, "models")
    header, row = out.splitlines()
    assert code == 0 and header.split()[:4] == ["MODEL", "BACKEND", "STATE", "READY"]
    assert row.split()[:4] == ["qwen", "llama_server", "loaded", "1/2"]
    code, out = await run_ctl(upstream, "--json", "models")
    assert code == 0 and out.startswith("{") and '"qwen"' in out


async def test_a_failed_startup_load_tried_again_says_when(upstream: Upstream) -> None:
    failed = {**MODEL, "state": "failed", "replicas": [], "last_error": "GET /v1/models failed: connection refused",
              "load_retry": {"attempts": 2, "next_retry_in_s": 9.6}}
    upstream.answers["/v1/admin/models"] = lambda r: web.json_response({"object": "list", "data": [failed]})
    code, out = await run_ctl(upstream, "models")
    assert code == 0 and "failed (next retry in 9.6s, 2 failed)" in out
    running = {**failed, "state": "loading", "load_retry": {"attempts": 2, "next_retry_in_s": None}}
    upstream.answers["/v1/admin/models/qwen/load"] = lambda r: web.json_response(running)
    code, out = await run_ctl(upstream, "load", "qwen")
    assert "qwen: loading (retrying now, 2 failed)" in out


async def test_logs_follow_polls_from_the_last_offset(upstream: Upstream) -> None:
    chunks = iter([("started\n", 8), ("line 2\n", 15), ("", 15)])

    def answer(request: web.Request) -> web.Response:
        text, offset = next(chunks)
        return web.json_response({"text": text, "offset": offset, "overflow": False})

    upstream.answers["/v1/admin/models/qwen/logs"] = answer
    polls = []

    def sleep(_s: float) -> None:
        polls.append(_s)
        if len(polls) == 3:
            raise KeyboardInterrupt  # what Ctrl-C does to a follow

    code, out = await _logs(upstream, sleep)
    assert code == 0 and out == "started\nline 2\n"
    assert [q for _, q, _, _ in upstream.seen] == [
        "/v1/admin/models/qwen/logs?replica=1&bytes=100",
        "/v1/admin/models/qwen/logs?replica=1&bytes=100&offset=8",
        "/v1/admin/models/qwen/logs?replica=1&bytes=100&offset=15"]


async def test_logs_without_a_replica_reads_the_models_first_whatever_its_index(upstream: Upstream) -> None:
    upstream.answers["/v1/admin/models/qwen/logs"] = lambda r: web.json_response({"text": "x\n", "offset": 2})
    code, out = await run_ctl(upstream, "logs", "qwen")
    assert code == 0 and [q for _, q, _, _ in upstream.seen] == ["/v1/admin/models/qwen/logs?bytes=16384"]


async def _logs(up: Upstream, sleep: Callable[[float], None]) -> tuple[int, str]:
    """`ctl logs -f` with an injected sleep, so the test decides when the follow ends."""
    args = build_parser().parse_args(["ctl", "--url", up.url, "logs", "qwen", "--replica", "1", "--bytes", "100",
                                      "-f"])
    out = io.StringIO()

    def call() -> int:
        client = ctl.AdminClient(up.url, None, 10)
        ctl.cmd_logs(client, args, out, sleep=sleep)
        return 0

    return await asyncio.to_thread(call), out.getvalue()


@pytest.mark.parametrize("status,code", [(404, ctl.EXIT_REFUSED), (401, ctl.EXIT_REFUSED), (409, ctl.EXIT_REFUSED),
                                         (502, ctl.EXIT_SERVER), (503, ctl.EXIT_SERVER)])
async def test_exit_codes_tell_refusals_from_server_failures(upstream: Upstream, status: int, code: int,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    error = {"error": {"message": "nope", "type": "x", "code": "some_code", "param": None}}
    upstream.answers["/v1/admin/models/qwen/unload"] = lambda r: web.json_response(error, status=status)
    got, out = await run_ctl(upstream, "unload", "qwen")
    assert (got, out) == (code, "")
    assert f"{status} some_code: nope" in capsys.readouterr().err


async def test_no_answer_is_a_server_error_and_a_bad_override_a_usage_error(upstream: Upstream) -> None:
    args = build_parser().parse_args(["ctl", "--url", f"http://127.0.0.1:{free_port()}", "gpu"])
    assert await asyncio.to_thread(ctl.run, args, io.StringIO(), {}) == ctl.EXIT_SERVER
    code, _ = await run_ctl(upstream, "load", "qwen", "--override", "no-equals-sign")
    assert code == ctl.EXIT_USAGE and upstream.seen == []


def test_url_and_token_come_from_the_settings(tmp_path, monkeypatch) -> None:
    conf = tmp_path / "pool.yaml"
    conf.write_text("service: {host: 0.0.0.0, port: 9123, admin_token_env: MY_TOKEN, state_dir: %s}\n" % tmp_path)
    args = build_parser().parse_args(["--config", str(conf), "ctl", "models"])
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(tmp_path / "none.yaml"))
    target = resolve_target(args, {"MY_TOKEN": "t1", "LLM_POOL_ADMIN_TOKEN": "t2"})
    assert (target.url, target.token, target.token_env) == ("http://127.0.0.1:9123", "t1", "MY_TOKEN")
    target = resolve_target(args, {"LLM_POOL_ADMIN_TOKEN": "t2"})
    assert (target.url, target.token, target.token_env) == ("http://127.0.0.1:9123", "t2", "LLM_POOL_ADMIN_TOKEN")
    conf.write_text("service: {port: 9123, admin_host: '::1', admin_port: 9124, state_dir: %s}\n" % tmp_path)
    target = resolve_target(args, {})
    assert (target.url, target.token, target.read) == ("http://[::1]:9124", None, ("LLM_POOL_ADMIN_TOKEN",))


async def test_a_refused_token_names_the_variable_it_came_from_never_the_token(
        upstream: Upstream, capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch) -> None:
    (tmp_path / "pool.yaml").write_text("service: {state_dir: %s}\n" % tmp_path)   # no admin_token_env
    monkeypatch.setenv("LLM_POOL_SETTINGS_PATH", str(tmp_path / "pool.yaml"))
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(tmp_path / "none.yaml"))
    error = {"error": {"message": "admin endpoints need Authorization: Bearer <admin token>", "type": "x",
                       "code": "invalid_admin_token", "param": None}}
    upstream.answers["/v1/admin/models"] = lambda r: web.json_response(error, status=401)
    got, _ = await run_ctl(upstream, "models", environ={"LLM_POOL_ADMIN_TOKEN": "wrong-SECRET-1"})
    err = capsys.readouterr().err
    assert got == ctl.EXIT_REFUSED and "wrong-SECRET-1" not in err
    assert err.rstrip().endswith("401 invalid_admin_token: admin endpoints need Authorization: Bearer <admin token> "
                                 "(ctl sent the token from $LLM_POOL_ADMIN_TOKEN)")
    got, _ = await run_ctl(upstream, "models", environ={})
    assert got == ctl.EXIT_REFUSED
    assert capsys.readouterr().err.rstrip().endswith("(ctl found no admin token: $LLM_POOL_ADMIN_TOKEN is not set)")


def test_the_token_source_names_every_variable_read_when_none_is_set() -> None:
    target = Target("http://x", None, ("MY_TOKEN", "LLM_POOL_ADMIN_TOKEN"), None)
    assert target.token_source() == "ctl found no admin token: $MY_TOKEN and $LLM_POOL_ADMIN_TOKEN are not set"


def test_gpu_table_says_why_nothing_was_measured_and_shows_unknown_memory() -> None:
    report = {"available": False, "reason": "NVML unavailable: ImportError: no pynvml", "gpus": [],
              "models": {"q": {"state": "loaded", "measured": None, "fits": None,
                               "estimate": {"per_replica_mib": 120.5, "total_mib": 241.0}}}}
    text = ctl.gpu_text(report)
    assert text.splitlines()[0] == "GPU memory not measured: NVML unavailable: ImportError: no pynvml"
    assert text.splitlines()[-1].split() == ["q", "loaded", "-", "120.5", "241.0", "-"]
    report.update(available=True, gpus=[{"index": 0, "name": "H100", "used_mib": 10.0, "total_mib": 80.0,
                                         "free_mib": 70.0, "note": None}])
    report["models"]["q"].update(measured={"used_mib": None, "reason": "container"}, fits={"0": True})
    lines = ctl.gpu_text(report).splitlines()
    assert lines[1].split() == ["0", "H100", "10.0", "80.0", "70.0", "-"]
    assert lines[-1].split() == ["q", "loaded", "unknown", "120.5", "241.0", "0:yes"]


def test_gpu_text_shows_each_nodes_devices_and_replicas_and_a_node_that_does_not_answer() -> None:
    report = {"available": False, "reason": "NVML unavailable", "gpus": [], "models": {},
              "hosts": {"local": {"available": False, "gpus": []},
                        "b": {"answering": True, "available": True,
                              "gpus": [{"index": 0, "name": "L4", "used_mib": 100.0, "total_mib": 24000.0,
                                        "free_mib": 23900.0}],
                              "cpu": {"total_mib": 64000.0, "available_mib": 50000.0},
                              "replicas": [{"replica": "m/r1", "program": "m-0123abcd-r1",
                                            "measured_mib": {"cpu": 80.5, "gpu0": 900.0}}]},
                        "c": {"answering": False, "available": False, "reason": "host c is not answering: timeout",
                              "gpus": [], "replicas": []}}}
    lines = ctl.gpu_text(report).splitlines()
    assert ["b", "gpu0", "L4", "100.0", "24000.0", "23900.0"] in [line.split() for line in lines]
    assert ["b", "cpu", "-", "-", "64000.0", "50000.0"] in [line.split() for line in lines]
    assert any(line.startswith("c ") and "not answering: timeout" in line for line in lines)
    assert ["b", "m/r1", "m-0123abcd-r1", "cpu", "80.5,", "gpu0", "900.0"] in [line.split() for line in lines]


@pytest.mark.parametrize("argv", [["ctl", "--json", "--url", "http://a:1", "models"],
                                  ["ctl", "models", "--json", "--url", "http://a:1"],
                                  ["ctl", "--url", "http://a:1", "load", "qwen", "--json"],
                                  ["ctl", "logs", "qwen", "--url", "http://a:1", "-f", "--json"]])
def test_json_and_url_are_taken_before_or_after_the_command(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.json, args.url) == (True, "http://a:1")


def test_an_option_after_the_command_wins_and_one_given_once_is_not_reset() -> None:
    args = build_parser().parse_args(["ctl", "--url", "http://before:1", "models", "--url", "http://after:2"])
    assert args.url == "http://after:2"
    # Given only before the command, the command's own (suppressed) default must not overwrite it.
    args = build_parser().parse_args(["ctl", "--json", "--timeout", "5", "gpu"])
    assert (args.json, args.url, args.timeout) == (True, None, 5.0)
    args = build_parser().parse_args(["ctl", "unload", "qwen", "--timeout", "7"])
    assert (args.json, args.timeout) == (False, 7.0)


async def test_models_json_after_the_command_prints_json(upstream: Upstream) -> None:
    upstream.answers["/v1/admin/models"] = lambda r: web.json_response({"object": "list", "data": [MODEL]})
    code, out = await run_ctl(upstream, "models", "--json")
    assert code == 0 and out.startswith("{") and '"qwen"' in out


def test_models_table_shows_idle_time_and_pinned() -> None:
    rows = [{"id": "coder", "state": "loaded", "replicas": [], "idle_for_s": 754.0, "idle_unload_s": 900, "pinned": False},
            {"id": "gemma", "state": "loaded", "replicas": [], "idle_for_s": 5.2, "idle_unload_s": None, "pinned": True},
            {"id": "busy", "state": "loaded", "replicas": [], "idle_for_s": None, "pinned": False},
            {"id": "cold", "state": "unloaded", "replicas": [], "idle_for_s": 3.0, "pinned": False,
             "backoff": {"attempts": 2, "next_attempt_in_s": 8.0}}]
    header, coder, gemma, busy, cold = ctl.models_table(rows).splitlines()
    assert "IDLE" in header.split() and "PINNED" in header.split()
    assert "13m/900s" in coder.split() and "yes" not in coder.split()
    assert "5s" in gemma.split() and "yes" in gemma.split()
    assert "-" in busy.split()
    assert "(backing off, next load in 8s)" in cold


def test_a_loaded_model_whose_queue_is_closed_says_it_refuses_requests_and_why() -> None:
    closed = {"open": False, "code": "model_already_loaded", "reason": "model 'duo' is loaded with other settings"}
    rows = [{**MODEL, "id": "duo", "admission": closed},
            {**MODEL, "id": "ok", "admission": {"open": True, "code": None, "reason": None}},
            # Not loaded: its state says what a request gets (refused, or loaded on demand).
            {**MODEL, "id": "gone", "state": "unloaded", "replicas": [], "admission": {**closed, "code": "x"}}]
    _, duo, ok, gone = ctl.models_table(rows).splitlines()
    assert "loaded (refusing requests: model_already_loaded)" in duo
    assert "refusing" not in ok and "refusing" not in gone
    assert "  refusing requests: model 'duo' is loaded with other settings" in ctl.model_summary(rows[0]).splitlines()
    assert "refusing" not in ctl.model_summary(rows[2])


def test_models_table_names_each_replicas_host_and_says_which_hosts_do_not_answer() -> None:
    rows = [{"id": "m", "state": "loaded", "replicas": [{"index": 0, "host": "a", "state": "ready"},
                                                         {"index": 1, "host": "b", "state": "host_unreachable"}]},
            {"id": "solo", "state": "loaded", "replicas": [{"index": 0, "host": "local", "state": "ready"}]}]
    header, m, solo = ctl.models_table(rows).splitlines()
    assert header.split()[4] == "HOSTS"
    assert "r0:a, r1:b (host unreachable)" in m and "1/2" in m.split()
    assert "r0:local" in solo
    assert "  replica 1: host_unreachable host=b pid=- port=None" in ctl.model_summary(rows[0]).splitlines()
    # One host: no column.
    assert "HOSTS" not in ctl.models_table(rows[1:])


EVENTS = [{"id": 7, "time": 0.0, "kind": "evict", "message": "model c is evicted to make room for s", "model": "c",
           "replica": None, "host": None, "reason": "evicted", "cause": "s", "actor": None},
          {"id": 8, "time": 0.0, "kind": "crash", "message": "model s replica 1 crashed:\x1b[2J gone", "model": "s",
           "replica": 1, "host": "local", "reason": "x", "cause": None, "actor": None}]


def test_an_event_line_shows_its_model_and_replica_and_no_control_character() -> None:
    assert ctl.event_line(EVENTS[1], when=lambda t: "12-02 04:00:00") == (
        "     8  12-02 04:00:00  crash        s/r1              model s replica 1 crashed:?[2J gone")


def test_a_host_events_line_names_its_host_where_a_models_names_the_model() -> None:
    down = {"id": 9, "time": 1.0, "kind": "host_down", "message": "host b stopped answering", "model": None,
            "replica": None, "host": "b", "reason": None, "cause": None, "actor": None}
    assert ctl.event_line(down, when=lambda t: "12-02 04:00:00") == (
        "     9  12-02 04:00:00  host_down    host b            host b stopped answering")


async def test_events_follow_polls_after_the_last_id_with_the_filters(upstream: Upstream) -> None:
    pages = iter([{"object": "list", "data": EVENTS[:1], "last_id": 7},
                  {"object": "list", "data": [], "last_id": 7},
                  {"object": "list", "data": EVENTS[1:], "last_id": 8}])
    upstream.answers["/v1/admin/events"] = lambda r: web.json_response(next(pages))
    polls: list[float] = []

    def sleep(s: float) -> None:
        polls.append(s)
        if len(polls) == 3:
            raise KeyboardInterrupt

    args = build_parser().parse_args(["ctl", "--url", upstream.url, "events", "--model", "c s", "--kind",
                                      "evict,crash", "--limit", "5", "-f"])
    out = io.StringIO()

    def call() -> None:
        ctl.cmd_events(ctl.AdminClient(upstream.url, None, 10), args, out, sleep=sleep)

    await asyncio.to_thread(call)
    assert [q for _, q, _, _ in upstream.seen] == [
        "/v1/admin/events?model=c+s&kind=evict%2Ccrash&limit=5",
        "/v1/admin/events?model=c+s&kind=evict%2Ccrash&after=7&limit=1000",
        "/v1/admin/events?model=c+s&kind=evict%2Ccrash&after=7&limit=1000"]
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["ID", "TIME", "KIND", "MODEL", "MESSAGE"]
    assert [line.split()[0] for line in lines[1:]] == ["7", "8"]
    assert "make room for s" in lines[1] and "s/r1" in lines[2]


async def test_events_json_prints_the_answer_and_a_refusal_exits_1(upstream: Upstream) -> None:
    answer = {"object": "list", "data": EVENTS, "last_id": 8}
    upstream.answers["/v1/admin/events"] = lambda r: web.json_response(answer)
    code, out = await run_ctl(upstream, "events", "--json")
    assert code == 0 and json.loads(out) == answer
    upstream.answers["/v1/admin/events"] = lambda r: web.json_response(
        {"error": {"code": "model_not_found", "message": "model 'x' is not configured"}}, status=404)
    code, _ = await run_ctl(upstream, "events", "--model", "x")
    assert code == ctl.EXIT_REFUSED
