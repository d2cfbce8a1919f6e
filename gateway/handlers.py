"""The gateway's routes: the OpenAI endpoints, model listing, liveness, readiness and metrics."""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

from specgate.gateway.errors import NoHealthyReplica
from specgate.gateway.metrics import CONTENT_TYPE
from specgate.gateway.state import FLEET, METRICS, RELAY, SESSION
from specgate.protocol.endpoints import Endpoint


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[RELAY].handle(request, Endpoint.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[RELAY].handle(request, Endpoint.COMPLETIONS)


async def models(request: web.Request) -> web.Response:
    """The replicas' own model list, passed through whole, so no field vLLM sets is lost."""
    session = request.app[SESSION]
    timeout = aiohttp.ClientTimeout(total=5)
    for replica in request.app[FLEET].replicas.values():
        if not replica.healthy:
            continue
        try:
            async with session.get(f"{replica.url}/v1/models", timeout=timeout) as upstream:
                if upstream.status != 200:
                    continue
                body = await upstream.read()
        except (aiohttp.ClientError, TimeoutError):
            continue
        return web.Response(body=body, content_type="application/json")
    raise NoHealthyReplica("no healthy replica to list the models")


async def health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"status":"ok"}', content_type="application/json")


async def ready(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    # Names, pools and health only: replicas' internal addresses are not for anyone who asks.
    replicas = {
        r.name: {"pool": r.pool.value, "healthy": r.healthy, "state": r.health.state.value, "drained": r.drained}
        for r in fleet.replicas.values()
    }
    ok = fleet.any_serving()
    body = {"status": "ready" if ok else "unready", "replicas": replicas}
    return web.Response(status=200 if ok else 503, body=orjson.dumps(body), content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].exposition(), headers={"Content-Type": CONTENT_TYPE})


def add_routes(app: web.Application) -> None:
    app.router.add_post(Endpoint.CHAT.value, chat_completions)
    app.router.add_post(Endpoint.COMPLETIONS.value, completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
