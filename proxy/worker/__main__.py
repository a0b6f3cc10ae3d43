"""`python -m proxy.worker`: one worker process, started by its controller (proxy/serving/workers.py)
with the service's listening sockets as inherited descriptors. Not a command for admins.

It serves until SIGTERM from its controller, or until the controller's channel ends (the
controller is gone): then it stops accepting, lets the requests it relays finish, and exits.
SIGINT is left to the controller, which stops the workers in its own order.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from aiohttp import web

from proxy.worker.app import Worker

KEEPALIVE_TIMEOUT_S = 75.0
# A stopping worker closes a connection left idle this long (as a reload's old process does).
IDLE_CLOSE_S = 2.0
# Headers and a body up to app.READ_WHOLE are read here; a larger body is streamed on.
CLIENT_MAX_SIZE = 1024 * 1024


async def run(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    worker = Worker(args.index, args.controller)
    await worker.line.connect(args.channel)
    app = web.Application(client_max_size=CLIENT_MAX_SIZE)
    app.router.add_route("*", "/{tail:.*}", worker.handle)
    app.on_response_prepare.append(worker.close_when_stopping)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT_S,
                           shutdown_timeout=args.drain_s)
    worker.runner = runner
    await runner.setup()
    socks = [socket.socket(fileno=fd) for fd in args.fd]
    sites = [web.SockSite(runner, sock) for sock in socks]
    for site in sites:
        await site.start()
    lost = asyncio.ensure_future(worker.line.lost.wait())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
    for task in (lost, stopping):
        task.cancel()
    logging.getLogger("llm-pool").info("worker %d: stopping (%s); %d request(s) in flight", args.index,
                                       "told to" if stop.is_set() else "the controller is gone", len(worker.passed))
    # As a reload's old process stops (proxy/serving/app.py: _finish_handed_over): not accepting,
    # every answer from now on with `Connection: close`, a connection that stays idle closed after
    # IDLE_CLOSE_S (one that carries a request meanwhile is answered and closed by it), and the
    # requests in flight let finish. A client on a kept-alive connection is never cut off mid-send.
    worker.stopping = True
    for site in sites:
        await site.stop()
    for sock in socks:
        sock.close()
    started = loop.time()
    await worker.drained(args.drain_s)
    linger = started + IDLE_CLOSE_S - loop.time()
    if linger > 0 and runner.server is not None and runner.server.connections:
        await asyncio.sleep(linger)
        await worker.drained(max(0.0, started + args.drain_s - loop.time()))
    await runner.cleanup()
    await worker.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--controller", required=True, help="the controller's HTTP Unix socket")
    parser.add_argument("--channel", required=True, help="the controller's channel Unix socket")
    parser.add_argument("--fd", type=int, action="append", required=True, help="an inherited listening socket")
    parser.add_argument("--drain-s", type=float, default=30.0)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="the controller's event loop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop
        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
