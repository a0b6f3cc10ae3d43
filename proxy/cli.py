"""The `llm-pool` command: serve, check-config, setup, ctl."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sqlite3
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Mapping

from launchers import launcher_for
from proxy import ctl
from proxy.config.checks import tenant_findings
from proxy.config.loading import ConfigError, load_settings
from proxy.config.settings import DEFAULT_NODE_USERNAME, Settings, is_loopback
from proxy.lifecycle.kinds.kind import kinds_for
from proxy.lifecycle.placement.memory import memory_warnings
from proxy.lifecycle.kinds.rules import EndpointRules, ProgramRules
from proxy.lifecycle.state.kind import KindRules
from proxy.masking import shown_url
from proxy.supervisord.host_login import try_logins
from proxy.supervisord.managed import StateDirBusy, claim_state_dir, inherited_lock

EXIT_CONFIG = 2
# LLM_POOL_EVENT_LOOP: `auto` (uvloop where it is installed), `uvloop` (required) or `asyncio`.
EVENT_LOOP_ENV = "LLM_POOL_EVENT_LOOP"
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def service_problems(settings: Settings, environ: Mapping[str, str] | None = None) -> list[str]:
    """What stops the proxy itself from starting: an admin token or a host's password variable that
    is named but not set, an admin API without a token on an address other machines reach."""
    environ = os.environ if environ is None else environ
    problems = []
    env = settings.service.admin_token_env
    if env and not environ.get(env, "").strip():
        # Fail closed: serving with the admin API open because a variable was forgotten is worse
        # than not serving. Name the variable, never a value.
        problems.append(settings.where(f"service.admin_token_env: {env} is unset or empty; set it to the admin "
                                       "token, or remove admin_token_env to leave the admin API without a token"))
    service = settings.service
    if not env and not service.admin_allow_unauthenticated_remote and not is_loopback(service.admin_listener_host):
        key = "service.admin_host" if service.admin_port is not None and service.admin_host else "service.host"
        problems.append(settings.where(
            f"{key}: the admin API would listen on {service.admin_listener_host} (not loopback) without a token, "
            "and whoever reaches it could load and unload models; set service.admin_token_env, or move the admin "
            "API to loopback (service.admin_port with admin_host: 127.0.0.1), or set "
            "service.admin_allow_unauthenticated_remote: true if that is meant"))
    problems += [settings.where(f"supervisor.hosts.{name}.password_env: {host.password_env} is unset or empty; "
                                f"set it to the password of the node at {shown_url(host.url)}")
                 for name, host in settings.supervisor.hosts.items() if not environ.get(host.password_env, "")]
    return problems


def startup_problems(settings: Settings) -> tuple[list[str], list[str]]:
    """What would stop a configured model from starting (an unsupported backend, a missing file, a
    value or an extra argument its engine refuses), each naming the file and line that set its key:
    of the models the pool loads by itself (enabled, or load_on_demand: a request loads it), and of
    those only an admin's load starts. Each costs only its model: `serve` goes on; `check-config`
    exits non-zero for the first, and warns of the second (errors too with --strict)."""
    automatic: list[str] = []
    admin_only: list[str] = []
    # The kinds' rules alone, without supervisord or an HTTP session: enough to check a model, not to run one.
    rules: dict[str, KindRules] = kinds_for({m.backend for m in settings.models.values()}, ProgramRules(),
                                            EndpointRules(os.environ))
    for name, model in settings.models.items():
        kind = rules.get(model.backend)
        found = kind.check(model) if kind is not None else [
            f"engine.models.{name}.backend: {model.backend!r} cannot be run by this version of llm-pool (set "
            "enabled: false and load_on_demand: false to keep it configured)"]
        (automatic if model.enabled or model.load_on_demand else admin_only).extend(found)
    return [settings.where(p) for p in automatic], [settings.where(p) for p in admin_only]


def _load_or_exit(config: str | None, strict: bool = False, host: str | None = None) -> Settings:
    """The settings, or exit 2 naming every structural problem (a wrong type, a bad value; with
    `strict`, unknown keys too; an admin token variable that is not set). Unknown keys are
    otherwise `settings.warnings`. `host` (serve --host) replaces service.host before the checks."""
    try:
        settings = load_settings(config, strict=strict)
    except ConfigError as exc:
        _report(exc.problems, exc.warnings)
        raise SystemExit(EXIT_CONFIG) from None
    if host:
        settings = replace(settings, service=replace(settings.service, host=host))
    problems = service_problems(settings)
    if problems:
        _report(problems, settings.warnings)
        raise SystemExit(EXIT_CONFIG)
    return settings


def _warn(warnings: Iterable[str]) -> None:
    for warning in warnings:
        print(f"llm-pool: warning: {warning}", file=sys.stderr)


def _report(problems: list[str], warnings: Iterable[str] = ()) -> None:
    """The problems, after the warnings: an error never hides a warning."""
    _warn(warnings)
    print(f"llm-pool: {len(problems)} configuration problem(s):", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)


def startup_warnings(settings: Settings) -> list[str]:
    """Settings of any model that load but work against the pool (a launcher's `warnings`)."""
    found: list[str] = []
    for model in settings.models.values():
        launcher = launcher_for(model.backend)
        if launcher is not None:
            found += launcher.warnings(model)
    return [settings.where(w) for w in found]


ADMIN_ONLY = "; an admin's load of this model (neither enabled nor load_on_demand) would fail"


def minted_keys(settings: Settings) -> list[tuple[str, str]] | None:
    """The live keys minted for tenants (tenant, digest), read from the ledger without writing to it
    (check-config changes nothing): none where there is no ledger yet, None where it cannot be read."""
    from proxy.serving.tenancy import LEDGER_FILE

    path = settings.service.state_dir / LEDGER_FILE
    if not path.exists():
        return []
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT tenant, sha256 FROM keys WHERE revoked IS NULL "
                                "ORDER BY tenant, created, key_id").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return None
    return [(str(tenant), str(sha)) for tenant, sha in rows]


def cmd_check_config(args: argparse.Namespace) -> int:
    settings = _load_or_exit(args.config, strict=args.strict)
    warnings = [*settings.warnings, *startup_warnings(settings), *memory_warnings(settings)]
    problems, admin_only = startup_problems(settings)
    tenant_errors, tenant_warnings = tenant_findings(settings, os.environ, minted_keys(settings)) \
        if settings.tenants else ([], [])
    problems += tenant_errors
    if args.strict:
        problems += [p + ADMIN_ONLY for p in admin_only] + tenant_warnings
    else:
        warnings += [p + ADMIN_ONLY for p in admin_only] + tenant_warnings
    if args.hosts:
        if not settings.supervisor.hosts:
            print("hosts: none configured (supervisor.hosts)")
        for login in asyncio.run(try_logins(settings, os.environ)):
            print(login)
            if login.problem:
                problems.append(settings.where(login.problem))
    if problems:
        _report(problems, warnings)
        return EXIT_CONFIG
    _warn(warnings)
    enabled = sum(1 for m in settings.models.values() if m.enabled)
    sources = ", ".join(str(s) for s in settings.sources)
    warned = f", {len(warnings)} warning(s)" if warnings else ""
    print(f"ok: {len(settings.models)} model(s), {enabled} enabled{warned} ({sources})")
    return 0


def event_loop_factory(environ: Mapping[str, str]) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The event loop `serve` runs on, and its name. uvloop where it is installed (a default
    dependency on Linux): measured by tests/bench/bench_proxy_overhead.py, the hop costs less CPU on
    it. ValueError names the variable and the rule for a value that cannot be honoured."""
    choice = environ.get(EVENT_LOOP_ENV, "auto").strip().lower() or "auto"
    if choice not in EVENT_LOOPS:
        raise ValueError(f"{EVENT_LOOP_ENV}={environ[EVENT_LOOP_ENV]!r}: must be one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return None, "asyncio"
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError(f"{EVENT_LOOP_ENV}=uvloop: uvloop is not installed in this interpreter "
                             "(pip install uvloop)") from None
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"


def cmd_serve(args: argparse.Namespace) -> int:
    from proxy.serving.app import create_app, serve
    from proxy.serving.handover import HandoverError, take_inherited

    # A reload's successor (proxy/serving/handover.py): taken first, so that nothing it starts
    # sees the variables, whatever happens next.
    try:
        inherited = take_inherited(os.environ)
    except HandoverError as exc:
        print(f"llm-pool: {exc}", file=sys.stderr)
        return 1
    settings = _load_or_exit(args.config, host=args.host)
    try:
        loop_factory, loop_name = event_loop_factory(os.environ)
    except ValueError as exc:
        print(f"llm-pool: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logging.basicConfig(level=settings.service.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("llm-pool")
    if inherited is not None:
        log.info("reload: started by pid %d to take over from it", inherited.predecessor)
    log.info("event loop: %s", loop_name)
    for warning in settings.warnings:
        log.warning("config: %s", warning)
    # A model that cannot start costs that model, not the service: it ends FAILED with this reason
    # when the pool tries to load it, and every other model serves.
    automatic, admin_only = startup_problems(settings)
    if automatic and inherited is not None:
        # A reload with such settings would swap a serving model for a failed one: it changes
        # nothing instead, as check-config (the unit's ExecStartPre) would refuse them at a start.
        _report(automatic)
        return EXIT_CONFIG
    for problem in automatic:
        log.error("config: %s (this model will not start; the others are served)", problem)
    for problem in admin_only:
        log.warning("config: %s%s", problem, ADMIN_ONLY)
    host = settings.service.host
    port = args.port or settings.service.port
    # Claim the state folder and the port before anything starts: a second `serve` by mistake must
    # fail at once, not adopt the first one's models and then unload them on its way out.
    try:
        lock = inherited_lock(settings.service.state_dir, inherited.lock_fd) if inherited is not None else None
        if inherited is not None and lock is None:
            os.close(inherited.lock_fd)   # service.state_dir changed: that folder is its own
        lock = lock or claim_state_dir(settings.service.state_dir)
    except StateDirBusy as exc:
        print(f"llm-pool: {exc}", file=sys.stderr)
        return 1
    listeners = [(host, port)]
    if settings.service.admin_port is not None:
        listeners.append((settings.service.admin_host or host, settings.service.admin_port))
    socks: list[socket.socket] = []
    for where in listeners:
        # A successor serves on its predecessor's socket where it listens at the same address.
        kept = inherited.take_listener(*where) if inherited is not None else None
        if kept is not None:
            socks.append(kept)
            continue
        try:
            socks.append(socket.create_server(where, family=socket.AF_INET6 if ":" in where[0] else socket.AF_INET))
        except OSError as exc:
            print(f"llm-pool: cannot listen on {where[0]}:{where[1]}: {exc.strerror}", file=sys.stderr)
            for sock in socks:
                sock.close()
            return 1
    if inherited is not None:
        inherited.close_untaken()
    banner = f"llm-pool serving on http://{host}:{port}"
    if len(listeners) > 1:
        banner += f", admin API on http://{listeners[1][0]}:{listeners[1][1]}"
    app = create_app(settings, keep_models=args.keep_models, successor=inherited is not None)
    with lock, contextlib.ExitStack() as stack:
        for sock in socks:
            stack.enter_context(sock)
        # Not web.run_app: it closes the listeners before the drain and the unload (see serve).
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(app, socks, lambda: print(banner, flush=True), lock, inherited, loop_name))
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    from proxy.setup.demo_lora import write_tiny_lora
    from proxy.setup.demo_model import write_tiny_gguf
    from proxy.setup.llama_build import build_llama_server

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        _report(exc.problems)
        return EXIT_CONFIG
    build_llama_server()
    demo = settings.models.get("demo")
    target = Path(demo.get("model_path")) if demo is not None and demo.get("model_path") else \
        settings.service.state_dir / "models" / "demo.gguf"
    if target.exists():
        print(f"demo model: present at {target}")
    else:
        write_tiny_gguf(target)
        print(f"demo model: wrote {target}")
    # The demo's tiny LoRA, where the settings serve it (conf/pool.yaml: demo:tiny, docs/adapters.md).
    tiny = demo.adapter("tiny") if demo is not None else None
    if tiny is not None and Path(tiny.path).exists():
        print(f"demo LoRA adapter: present at {tiny.path}")
    elif tiny is not None:
        write_tiny_lora(Path(tiny.path))
        print(f"demo LoRA adapter: wrote {tiny.path}")
    if args.all_engines:
        from proxy.setup.engine_setup import prepare
        prepare()
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from proxy.supervisord.node_host import NodeError, run_node

    try:
        run_node(args.listen, Path(args.state_dir), args.username)
    except NodeError as exc:
        print(f"llm-pool node: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0   # not reached: run_node becomes supervisord


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-pool",
                                     description="One OpenAI-compatible endpoint for many LLM runtimes.")
    parser.add_argument("--config", help="settings file (default: $LLM_POOL_SETTINGS_PATH or conf/pool.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start supervisord if needed, load enabled models, serve the API")
    serve.add_argument("--host", help="override service.host")
    serve.add_argument("--port", type=int, help="override service.port")
    serve.add_argument("--keep-models", action="store_true",
                       help="on exit leave supervisord and the models running, for the next proxy to adopt")
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate the settings; print every problem and exit non-zero")
    check.add_argument("--strict", action="store_true",
                       help="unknown keys, problems of models only an admin loads, and tenant mistakes are "
                            "errors, not warnings (for an admin's CI)")
    check.add_argument("--hosts", action="store_true",
                       help="also log into each node of supervisor.hosts and say whether it answered and the "
                            "login worked")
    check.set_defaults(func=cmd_check_config)
    setup = sub.add_parser("setup", help="build llama-server if not cached and write the demo model")
    setup.add_argument("--all-engines", action="store_true",
                       help="also prepare every other engine's environment in the cache (what the tests need)")
    setup.set_defaults(func=cmd_setup)
    node = sub.add_parser("node", help="run this host's supervisord as a node of a pool on another machine "
                                       "(password from $LLM_POOL_NODE_PASSWORD)")
    node.add_argument("--listen", required=True, help="HOST:PORT of its inet_http_server (a private address)")
    node.add_argument("--state-dir", required=True, help="folder for its config, programs and logs")
    node.add_argument("--username", default=DEFAULT_NODE_USERNAME, help="the username the proxy logs in with")
    node.set_defaults(func=cmd_node)
    ctl.add_parser(sub)
    for p in (serve, check, setup):
        p.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
