"""The simplest aiohttp relay, as a yardstick: what any Python router pays before doing anything.

It forwards POST bodies to one upstream and relays the answer, streamed or not, with one pooled
session, and nothing else: no routing, headers, metrics or error handling. PEERS.md lists such a
relay beside the production routers; measuring it in the same run as the gateway shows how much
of the gateway's cost is the language and framework, and how much is the gateway's own work.

    python -m specgate.bench.bare_relay --upstream URL --port 0
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from specgate.protocol.serving import serve_until_cancelled

SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
    async with request.app[SESSION].post(request.app[UPSTREAM] + request.path, data=body, headers=headers) as up:
        if up.content_type != "text/event-stream":
            return web.Response(status=up.status, body=await up.read(), content_type=up.content_type)
        response = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in up.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def _session(app: web.Application) -> AsyncIterator[None]:
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app[SESSION].close()


def main() -> None:
    parser = argparse.ArgumentParser(description="the simplest aiohttp relay, for comparison")
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/chat/completions", relay)

    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(
            serve_until_cancelled(
                app, "127.0.0.1", args.port, lambda url: print(f"bare relay listening on {url}", flush=True)
            )
        )


if __name__ == "__main__":
    main()
