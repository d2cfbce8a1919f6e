"""Application assembly and lifecycle.

One `cleanup_ctx` owns every shared resource: the single upstream `ClientSession`, the fleet and
its scrapers, the relay. Cleanup runs only if start-up succeeded; scrapers are cancelled and
awaited on the way out. Serving waits for in-flight requests up to the shutdown grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from gateway.config import GatewaySettings
from gateway.errors import openai_errors
from gateway.handlers import add_routes
from gateway.metrics import GatewayMetrics
from gateway.relay import Relay
from gateway.state import FLEET, METRICS, RELAY, SESSION, SETTINGS
from policies.latency_model import LatencyModel
from policies.registry import RoutingPlan, build_policy
from workers.http import serve_until_cancelled
from workers.pools import Fleet
from workers.sim.profiles import get_profile

_log = logging.getLogger(__name__)


def routing_plan(settings: GatewaySettings) -> RoutingPlan:
    model = LatencyModel(get_profile(settings.policy.profile))
    policy = build_policy(settings.policy.name, settings.policy.params, model)
    return RoutingPlan(policy, model, settings.policy.allow_pool_override)


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    plan = routing_plan(settings)
    fleet = Fleet({pool: list(urls) for pool, urls in settings.pools.items()}, settings.fleet)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.timeouts.connect_s),
        auto_decompress=False,  # relay the bytes as the replica sent them
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )
    metrics = GatewayMetrics(fleet, plan.version)
    relay = Relay(settings, fleet, session, metrics, plan)
    app[SESSION], app[FLEET], app[METRICS], app[RELAY] = session, fleet, metrics, relay
    # One round of scrapes before serving, so a gateway in front of live replicas is ready at once.
    await asyncio.gather(*(fleet.scrape_once(session, r) for r in fleet.replicas.values()))
    scrapers = [
        asyncio.create_task(fleet.scrape_forever(session, r), name=f"scrape-{r.name}") for r in fleet.replicas.values()
    ]
    try:
        yield
    finally:
        for task in scrapers:
            task.cancel()
        for task in scrapers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await session.close()


def make_app(settings: GatewaySettings) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_resources)
    add_routes(app)
    return app


async def serve(settings: GatewaySettings, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until cancelled; on the way out, stop accepting and let requests in flight finish."""
    app = make_app(settings)
    await serve_until_cancelled(app, settings.host, settings.port, on_ready, settings.shutdown_grace_s)
