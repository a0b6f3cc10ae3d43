"""`llm-pool ctl`: operate a running proxy through its admin API.

Human tables by default, `--json` for scripts. Exit codes (documented in docs/operating.md):
0 success; 1 the server refused the request (4xx: unknown model, bad override, missing token);
2 usage error (bad arguments, caught before anything is sent); 3 the server failed or did not
answer (5xx, connection refused, timeout): worth retrying later.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Mapping, Sequence, TextIO

import yaml

from proxy import ctl_tenants
from proxy.ctl_target import resolve_target
from proxy.masking import shown_url

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_SERVER = 3
FOLLOW_INTERVAL_S = 1.0


MIB = 1024 * 1024


class CtlError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class AdminClient:
    """The admin API over HTTP; errors become CtlError with the exit code they mean. `token_source`:
    which variable the token came from (or that none was set), added to a 401."""

    def __init__(self, url: str, token: str | None, timeout: float, token_source: str = "") -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.token_source = token_source

    def call(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            text = _error_text(err)
            if err.code == 401 and self.token_source:
                text += f" ({self.token_source})"
            raise CtlError(text, EXIT_REFUSED if err.code < 500 else EXIT_SERVER) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CtlError(f"no answer from {shown_url(self.url)}: {reason}", EXIT_SERVER) from None
        except ValueError:
            raise CtlError(f"{shown_url(self.url)}{path} did not answer JSON", EXIT_SERVER) from None


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        error = json.loads(err.read())["error"]
        return f"{err.code} {error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"{err.code} {err.reason}"


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


# -- output -----------------------------------------------------------------------------------------

def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def models_table(data: list[dict[str, Any]]) -> str:
    rows = []
    for m in data:
        replicas = m.get("replicas") or []
        ready = sum(1 for r in replicas if r.get("state") == "ready")
        error = m.get("last_error") or next((r.get("last_error") for r in replicas if r.get("last_error")), None)
        rows.append([m["id"], m.get("backend"), _state(m), f"{ready}/{len(replicas)}",
                     m.get("replica_max"), m.get("active"), m.get("waiting"), _idle(m),
                     "yes" if m.get("pinned") else None,
                     (error or "").splitlines()[0][:60] if error else None])
    headers = ["MODEL", "BACKEND", "STATE", "READY", "MAX", "ACTIVE", "WAITING", "IDLE", "PINNED", "LAST ERROR"]
    if any((r.get("host") or "local") != "local" for m in data for r in m.get("replicas") or []):
        # Several hosts: where each replica runs (one host, the column says nothing), and which
        # ones are out of rotation because their host does not answer.
        headers.insert(4, "HOSTS")
        for row, m in zip(rows, data):
            row.insert(4, ", ".join(_replica_host(r) for r in m.get("replicas") or []) or None)
    return table(headers, rows)


def _replica_host(r: dict[str, Any]) -> str:
    shown = f"r{r.get('index')}:{r.get('host') or 'local'}"
    return f"{shown} (host unreachable)" if r.get("state") == "host_unreachable" else shown


def hosts_table(data: list[dict[str, Any]]) -> str:
    rows = []
    for h in data:
        devices = h.get("devices") or {}
        gpus = devices.get("gpus") or []
        memory = {d["device"]: d for d in h.get("memory") or []}
        free = ", ".join(f"{name} {row['free_bytes'] / MIB:.0f}" for name, row in sorted(memory.items())
                         if row.get("free_bytes") is not None)
        rows.append([h["name"], h.get("url") or "(this machine)", "yes" if h.get("answering") else
                     f"no ({h.get('down_for_s')}s)", len(gpus) if devices else None, free or None,
                     h.get("replicas"), (h.get("error") or "")[:60] or None])
    return table(["HOST", "URL", "ANSWERING", "GPUS", "FREE MIB", "REPLICAS", "ERROR"], rows)


def _idle(m: dict[str, Any]) -> str | None:
    """How long the model has had no request, as `12m` or `3s`; with its idle unload time."""
    idle = m.get("idle_for_s")
    if idle is None:
        return None
    shown = f"{idle / 3600:.1f}h" if idle >= 3600 else f"{idle / 60:.0f}m" if idle >= 60 else f"{idle:.0f}s"
    limit = m.get("idle_unload_s")
    return f"{shown}/{limit:g}s" if limit is not None else shown


def _state(m: dict[str, Any]) -> str:
    """The model's state; a loaded model's closed queue with the code every request gets."""
    closed = _closed(m)
    shown = _lifecycle_state(m)
    return f"{shown} (refusing requests: {closed.get('code')})" if closed else shown


def _closed(m: dict[str, Any]) -> dict[str, Any] | None:
    """A loaded model's admission when it is closed. Only there does it refuse what the state would
    serve: in every other state the state says what a request gets (refused, or loaded on demand)."""
    admission = m.get("admission") or {}
    return admission if m.get("state") == "loaded" and not admission.get("open", True) else None


def _lifecycle_state(m: dict[str, Any]) -> str:
    """The model's state, and where a failed startup load is tried again, when."""
    retry = m.get("load_retry")
    backoff = m.get("backoff")
    if backoff:
        return f"{m.get('state')} (backing off, next load in {backoff.get('next_attempt_in_s'):g}s)"
    if not retry:
        return str(m.get("state"))
    left = retry.get("next_retry_in_s")
    when = "retrying now" if left is None else f"next retry in {left:g}s"
    return f"{m.get('state')} ({when}, {retry.get('attempts')} failed)"


def model_summary(m: dict[str, Any]) -> str:
    lines = [f"{m['id']}: {_state(m)}"]
    for r in m.get("replicas") or []:
        outdated = f" (out of date: {r['outdated']})" if r.get("outdated") else ""
        host = f" host={r['host']}" if r.get("host") not in (None, "local") else ""
        adapters = f" adapters={','.join(r['adapters'])}" if r.get("adapters") else ""
        lines.append(f"  replica {r['index']}: {r['state']}{host} pid={r.get('pid') or '-'} "
                     f"port={r.get('port')}{adapters}{outdated}")
    if m.get("last_error"):
        lines.append(f"  last error: {m['last_error']}")
    closed = _closed(m)
    if closed:
        lines.append(f"  refusing requests: {closed.get('reason')}")
    return "\n".join(lines)


def gpu_text(report: dict[str, Any]) -> str:
    parts = []
    if report.get("available"):
        parts.append(table(["GPU", "NAME", "USED MIB", "TOTAL MIB", "FREE MIB", "NOTE"],
                           [[g["index"], g["name"], g["used_mib"], g["total_mib"], g["free_mib"], g.get("note")]
                            for g in report.get("gpus", [])]))
    else:
        parts.append(f"GPU memory not measured: {report.get('reason')}")
    rows = []
    for name, m in report.get("models", {}).items():
        measured = m.get("measured")
        used = None if measured is None else (measured.get("used_mib") if measured.get("used_mib") is not None
                                              else "unknown")
        est = m.get("estimate") or {}
        fits = m.get("fits")
        rows.append([name, m.get("state"), used, est.get("per_replica_mib"), est.get("total_mib"),
                     None if fits is None else ",".join(f"{i}:{'yes' if ok else 'no'}" for i, ok in fits.items())])
    parts.append(table(["MODEL", "STATE", "USED MIB", "EST/REPLICA MIB", "EST TOTAL MIB", "FITS"], rows))
    nodes = {n: h for n, h in (report.get("hosts") or {}).items() if n != "local"}
    if nodes:
        # Several hosts: the tables above are this machine's; each node's devices and replicas follow.
        parts.append(table(["HOST", "DEVICE", "NAME", "USED MIB", "TOTAL MIB", "FREE MIB"],
                           [[n, f"gpu{g['index']}", g["name"], g["used_mib"], g["total_mib"], g["free_mib"]]
                            for n, h in nodes.items() for g in h.get("gpus") or []] +
                           [[n, "cpu", None, None, (h.get("cpu") or {}).get("total_mib"),
                             (h.get("cpu") or {}).get("available_mib")] for n, h in nodes.items() if h.get("cpu")] +
                           [[n, None, h.get("reason"), None, None, None] for n, h in nodes.items()
                            if not h.get("answering")]))
        parts.append(table(["HOST", "REPLICA", "PROGRAM", "MEASURED MIB"],
                           [[n, r["replica"], r["program"], ", ".join(f"{d} {b}" for d, b in r["measured_mib"].items())
                             or None] for n, h in nodes.items() for r in h.get("replicas") or []]))
    return "\n\n".join(parts)


# -- commands ---------------------------------------------------------------------------------------

def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """`k=v` pairs; each value is read as YAML, so numbers, booleans, null and {...} keep their type."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CtlError(f"--override {pair!r}: expected KEY=VALUE", EXIT_USAGE)
        try:
            overrides[key] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            raise CtlError(f"--override {pair!r}: the value is not valid YAML", EXIT_USAGE) from None
    return overrides


def cmd_models(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    _show(client.call("GET", "/v1/admin/models"), lambda data: models_table(data["data"]), args, out)


def cmd_load(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    body: dict[str, Any] = {}
    if args.override:
        body["overrides"] = parse_overrides(args.override)
    if args.replicas is not None:
        body["replicas"] = args.replicas
    _show_model(client.call("POST", f"/v1/admin/models/{_quote(args.name)}/load", body), args, out)


def cmd_unload(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    _show_model(client.call("POST", f"/v1/admin/models/{_quote(args.name)}/unload"), args, out)


def cmd_scale(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    _show_model(client.call("POST", f"/v1/admin/models/{_quote(args.name)}/scale", {"replicas": args.replicas}),
                args, out)


def _show_model(model: dict[str, Any], args: argparse.Namespace, out: TextIO) -> None:
    _show(model, model_summary, args, out)


def _show(data: Any, as_text: Callable[[Any], str], args: argparse.Namespace, out: TextIO) -> None:
    """The admin API's answer as it came (--json), or as text for a person."""
    if args.json:
        json.dump(data, out, indent=2)
        out.write("\n")
    else:
        out.write(as_text(data) + "\n")


def cmd_adapter(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    path = f"/v1/admin/models/{_quote(args.name)}/adapters/{_quote(args.adapter)}/{args.action}"
    _show_model(client.call("POST", path), args, out)


def cmd_hosts(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    _show(client.call("GET", "/v1/admin/hosts"), lambda data: hosts_table(data["data"]), args, out)


def cmd_processes(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    _show(client.call("GET", "/v1/admin/processes"), lambda data: processes_table(data["data"]), args, out)


def cmd_batches(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    _show(client.call("GET", "/v1/admin/batches"), batches_text, args, out)


def batches_text(view: dict[str, Any]) -> str:
    """Each batch's progress and rate, then each model's batch class queue (docs/batches.md)."""
    rows = [(b["id"], b.get("owner") or "-", b.get("model") or "?", b["status"],
             f"{b['completed'] + b['failed']}/{b['total']}", str(b["failed"]), str(b["inflight"]),
             "-" if b.get("lines_per_s") is None else f"{b['lines_per_s']:g}/s") for b in view["data"]]
    text = table(("BATCH", "TENANT", "MODEL", "STATUS", "DONE", "FAILED", "IN FLIGHT", "RATE"), rows) \
        if rows else "no batches"
    for model, queue in sorted(view.get("queues", {}).items()):
        text += (f"\n{model}: batch class {queue.get('running', 0)} running, {queue.get('waiting', 0)} waiting"
                 f" (oldest {queue.get('oldest_wait_s', 0)} s)")
    storage = view.get("storage")
    if storage:
        text += f"\nfiles: {storage['used_bytes']:,} of {storage['max_bytes']:,} bytes"
    return text


def processes_table(rows: Sequence[dict[str, Any]]) -> str:
    def shown(value: Any) -> str:
        return "?" if value is None else str(value)
    return table(("ROLE", "PID", "STATE", "CONNECTIONS", "REQUESTS", "RESTARTS"),
                 [(r["role"] if r.get("index") is None else f"{r['role']} {r['index']}", shown(r.get("pid")),
                   r.get("state", ""), shown(r.get("connections")), shown(r.get("requests")), shown(r.get("restarts")))
                  for r in rows])


def cmd_gpu(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    _show(client.call("GET", "/v1/admin/gpu-memory"), gpu_text, args, out)


def cmd_logs(client: AdminClient, args: argparse.Namespace, out: TextIO,
             sleep: Callable[[float], None] = time.sleep) -> None:
    """Print the replica's log tail; with --follow keep polling from the last offset until
    interrupted (Ctrl-C ends it with exit 0)."""
    replica = "" if args.replica is None else f"replica={args.replica}&"
    base = f"/v1/admin/models/{_quote(args.name)}/logs?{replica}bytes={args.bytes}"
    chunk = client.call("GET", base)
    _write_log(chunk, args, out)
    try:
        while args.follow:
            sleep(FOLLOW_INTERVAL_S)
            chunk = client.call("GET", f"{base}&offset={chunk['offset']}")
            _write_log(chunk, args, out)
    except KeyboardInterrupt:
        pass


def _write_log(chunk: dict[str, Any], args: argparse.Namespace, out: TextIO) -> None:
    if args.json:
        out.write(json.dumps(chunk) + "\n")
    else:
        out.write(chunk.get("text", ""))
    out.flush()


EVENT_HEADER = f"{'ID':>6}  {'TIME':<14}  {'KIND':<11}  {'MODEL':<16}  MESSAGE"


def event_line(e: dict[str, Any], when: Callable[[float], str] | None = None) -> str:
    """One event as a line of `ctl events`; a control character the message may carry (an engine's
    error text is in some) is shown as `?`, so nothing it holds can drive the terminal."""
    stamp = (when or (lambda t: time.strftime("%m-%d %H:%M:%S", time.localtime(t))))(float(e.get("time") or 0))
    message = "".join(c if c.isprintable() else "?" for c in str(e.get("message", "")))
    # A host's event names no model: the host is what it is about.
    model = e.get("model") or (f"host {e['host']}" if e.get("host") else "-")
    if e.get("replica") is not None:
        model = f"{model}/r{e['replica']}"
    return f"{e.get('id', 0):>6}  {stamp:<14}  {str(e.get('kind')):<11}  {model:<16}  {message}"


def cmd_events(client: AdminClient, args: argparse.Namespace, out: TextIO,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """The newest `--limit` events (of `--model`, of `--kind`), oldest first; with --follow keep
    polling for newer ones (`after` the last id seen) until interrupted (Ctrl-C ends it with exit 0)."""
    query = {k: v for k, v in (("model", args.model), ("kind", args.kind)) if v}

    def path(**more: object) -> str:
        return "/v1/admin/events?" + urllib.parse.urlencode({**query, **more})

    page = client.call("GET", path(limit=args.limit))
    if args.json and not args.follow:
        json.dump(page, out, indent=2)
        out.write("\n")
        return
    if not args.json:
        out.write(EVENT_HEADER + "\n")
    after = page.get("last_id", 0)
    try:
        while True:
            for event in page.get("data") or []:
                out.write((json.dumps(event) if args.json else event_line(event)) + "\n")
            out.flush()
            if not args.follow:
                return
            sleep(FOLLOW_INTERVAL_S)
            page = client.call("GET", path(after=after, limit=1000))
            after = max(after, page.get("last_id", after))
    except KeyboardInterrupt:
        pass


def cmd_usage(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    query = {k: v for k, v in (("from", args.since), ("to", args.until), ("group_by", args.group_by)) if v}
    page = client.call("GET", "/v1/admin/usage?" + urllib.parse.urlencode(query))
    groups = args.group_by.split(",")
    _show(page, lambda p: (ctl_tenants.usage_csv if args.csv else ctl_tenants.usage_table)(p["data"], groups),
          args, out)


def cmd_keys(client: AdminClient, args: argparse.Namespace, out: TextIO) -> None:
    if args.action == "mint":
        minted = client.call("POST", f"/v1/admin/tenants/{_quote(args.tenant)}/keys", {})
        # The key is shown this once (the pool keeps only its digest): to stdout, for a pipe.
        _show(minted, lambda m: f"{m['key']}\n(id {m['id']}; the key is not shown again)", args, out)
    elif args.action == "revoke":
        _show(client.call("DELETE", f"/v1/admin/tenants/{_quote(args.tenant)}/keys/{_quote(args.id)}"),
              lambda r: f"revoked key {r['id']}", args, out)
    else:
        _show(client.call("GET", "/v1/admin/tenants"), lambda d: ctl_tenants.keys_table(d["data"]), args, out)


COMMANDS: dict[str, Callable[..., None]] = {"models": cmd_models, "load": cmd_load, "unload": cmd_unload,
                                            "scale": cmd_scale, "logs": cmd_logs, "gpu": cmd_gpu,
                                            "hosts": cmd_hosts, "events": cmd_events, "usage": cmd_usage,
                                            "keys": cmd_keys, "processes": cmd_processes, "batches": cmd_batches,
                                            "adapter": cmd_adapter}


# -- wiring -----------------------------------------------------------------------------------------

def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `ctl` and its commands to the `llm-pool` subparsers."""
    ctl: argparse.ArgumentParser = sub.add_parser("ctl", help="operate a running proxy through its admin API",
                         description="Exit codes: 0 ok, 1 refused by the server (4xx), 2 usage error, "
                                     "3 server error or no answer (5xx, connection refused, timeout).")
    _add_common(ctl, defaults=True)
    ctl.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    cmds = ctl.add_subparsers(dest="ctl_command", required=True)
    models = cmds.add_parser("models", help="every configured model: state, ready replicas, queues, last error")
    load = cmds.add_parser("load", help="load a configured model (answers once it is ready or failed)")
    load.add_argument("name")
    load.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="temporary override, repeatable (see `ctl models --json` load_constraints)")
    load.add_argument("--replicas", type=int, help="replica count, up to the model's replica_max")
    unload = cmds.add_parser("unload", help="drain and stop a model")
    unload.add_argument("name")
    scale = cmds.add_parser("scale", help="change a loaded model's replica count")
    scale.add_argument("name")
    scale.add_argument("replicas", type=int)
    adapter = cmds.add_parser("adapter", help="load or unload one of a loaded model's LoRA adapters on its "
                                              "replicas (vLLM; llama-server holds its adapters until it stops)")
    adapter.add_argument("action", choices=("load", "unload"))
    adapter.add_argument("name", help="the base model")
    adapter.add_argument("adapter", help="the adapter's name under lora_adapters")
    logs = cmds.add_parser("logs", help="a replica's log, read through the admin API")
    logs.add_argument("name")
    logs.add_argument("--replica", type=int, help="replica index (default: the model's first; a rolled "
                      "model's may start past 0)")
    logs.add_argument("--bytes", type=int, default=16384, help="how much of the end of the log (default 16384)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing what is written, like tail -f")
    gpu = cmds.add_parser("gpu", help="GPU memory: measured per GPU and model, estimated per model")
    # Users type `ctl models --json` as often as `ctl --json models`: every command takes the
    # common options too, with no default of its own, so one given before the command is kept.
    hosts = cmds.add_parser("hosts", help="every host: reachability, devices, free memory, replicas")
    processes = cmds.add_parser("processes", help="the proxy's processes: the controller and its workers, with "
                                                  "their PIDs, client connections and requests in flight")
    batches = cmds.add_parser("batches", help="the Batch API's batches: progress, rate, and each model's batch "
                                              "class queue")
    events = cmds.add_parser("events", help="what happened: loads, unloads and why, evictions, crashes, "
                                            "ejections, hosts, admin actions and who")
    events.add_argument("--model", help="only this model's events")
    events.add_argument("--kind", help="only these kinds, comma-separated (load,unload,evict,crash,...)")
    events.add_argument("--limit", type=int, default=50, help="how many of the newest to show first (1-1000, "
                        "default 50)")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events as they come")
    usage = cmds.add_parser("usage", help="what each tenant used and spent (the usage ledger)")
    usage.add_argument("--from", dest="since", help="start: unix seconds or an ISO date or time (UTC)")
    usage.add_argument("--to", dest="until", help="end: unix seconds or an ISO date or time (UTC)")
    usage.add_argument("--group-by", default="tenant,model,day",
                       help="comma-separated of tenant, model, day, key_id, backend, host (default tenant,model,day)")
    usage.add_argument("--csv", action="store_true", help="the rows as CSV")
    keys = cmds.add_parser("keys", help="tenants' keys by id; `keys mint TENANT`, `keys revoke TENANT ID`")
    keys.add_argument("action", nargs="?", choices=("list", "mint", "revoke"), default="list")
    keys.add_argument("tenant", nargs="?")
    keys.add_argument("id", nargs="?")
    for command in (models, load, unload, scale, adapter, logs, gpu, hosts, processes, batches, events, usage, keys):
        _add_common(command, defaults=False)
    ctl.set_defaults(func=run)
    return ctl


def _add_common(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--url, --json and --timeout; with `defaults` False they are absent from the namespace unless
    given, so a subcommand's parser leaves what the `ctl` parser read (argparse copies every
    attribute a subparser sets onto the parent's namespace)."""
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--url", default=default(None),
                        help="the proxy's base URL (default: where the running proxy recorded it listens, in its "
                             "state folder; else service.host and service.port of the settings)")
    parser.add_argument("--json", action="store_true", default=default(False),
                        help="print the API's JSON instead of tables")
    parser.add_argument("--timeout", type=float, default=default(600.0),
                        help="seconds to wait for an answer (a load waits until the model is ready)")


def run(args: argparse.Namespace, out: TextIO = sys.stdout, environ: Mapping[str, str] | None = None) -> int:
    if args.ctl_command == "keys" and args.action != "list" and not args.tenant or \
            args.ctl_command == "keys" and args.action == "revoke" and not args.id:
        print("llm-pool ctl keys: mint needs TENANT, revoke needs TENANT and ID", file=sys.stderr)
        return EXIT_USAGE
    try:
        target = resolve_target(args, os.environ if environ is None else environ)
        COMMANDS[args.ctl_command](AdminClient(target.url, target.token, args.timeout, target.token_source()),
                                   args, out)
    except CtlError as exc:
        print(f"llm-pool ctl: {exc}", file=sys.stderr)
        return exc.exit_code
    return EXIT_OK
