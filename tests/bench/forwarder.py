"""A bare aiohttp forwarder: the yardstick for what one proxy hop costs, with nothing of llm-pool's.

Every POST goes to the same path on one upstream, body and content type as they came; the answer
comes back with its status and content type, streamed chunk by chunk as it arrives. No routing, no
queues, no metrics: what any aiohttp proxy pays for the hop itself. Run as its own process, as the
proxy is, so that both are measured the same way.

    python tests/bench/forwarder.py --port 9000 --upstream http://127.0.0.1:8080 [--uvloop]
"""
from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def create_app(upstream: str) -> web.Application:
    session: list[aiohttp.ClientSession] = []

    async def open_session(_: web.Application) -> None:
        session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))

    async def close_session(_: web.Application) -> None:
        await session[0].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session[0].post(upstream + request.path, data=body,
                                   headers={"Content-Type": request.content_type}) as resp:
            out = web.StreamResponse(status=resp.status,
                                     headers={"Content-Type": resp.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--uvloop", action="store_true", help="on uvloop's event loop instead of asyncio's")
    args = parser.parse_args()
    loop = None
    if args.uvloop:
        import uvloop
        loop = uvloop.new_event_loop()
    web.run_app(create_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
