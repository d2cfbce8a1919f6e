"""Application assembly and lifecycle.

One `cleanup_ctx` owns every shared resource: the single upstream `ClientSession`, the fleet and
its scrapers, the relay, the policy control and, with a store, its Redis client and the task that
follows it. Cleanup runs only if start-up succeeded; background tasks are cancelled and awaited on
the way out. Serving waits for in-flight requests up to the shutdown grace period, then answers
those still running (a 503, or an error event that ends a stream) instead of dropping them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial

import aiohttp
from aiohttp import web

from specgate.calibration.modes import Pool
from specgate.gateway.admin import add_admin_routes
from specgate.gateway.admission import AdmissionControl
from specgate.gateway.advisor import Advisor
from specgate.gateway.clients import Clients, merged, parse_keys
from specgate.gateway.config import GatewaySettings
from specgate.gateway.connections import Connections
from specgate.gateway.errors import SERVER, openai_errors
from specgate.gateway.exchange import CountExchange
from specgate.gateway.handlers import add_routes
from specgate.gateway.metrics import GatewayMetrics
from specgate.gateway.policy_sync import STORE_ERRORS, PolicyControl
from specgate.gateway.relay import Relay
from specgate.gateway.server import GuardedRunner
from specgate.gateway.state import ADVISOR, FLEET, METRICS, POLICY, RELAY, SESSION, SETTINGS
from specgate.gateway.store import PolicyStore
from specgate.gateway.switching import Switcher, SwitchError
from specgate.gateway.tracing import Tracer
from specgate.protocol.serving import serve_until_cancelled
from specgate.validation import Invalid
from specgate.workers.discovery import Discovery, PoolSources, source
from specgate.workers.pools import Fleet, Replica
from specgate.workers.shared import SharedCounts

_log = logging.getLogger(__name__)


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    group = settings.processes
    shared = _shared_counts(settings)
    fleet = Fleet({pool: list(urls) for pool, urls in settings.pools.items()}, settings.fleet, shared)
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
    session = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.timeouts.connect_s),
        auto_decompress=False,  # relay the bytes as the replica sent them
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )
    # Scrapes and health checks on connections of their own: sharing the request pool, whose idle
    # connections are taken first in first out, they would use each in turn every few seconds and
    # keep all of them open at the peak's count for ever.
    probes = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit_per_host=4, ttl_dns_cache=300, enable_cleanup_closed=True),
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )
    metrics = GatewayMetrics(
        fleet, with_store=settings.store.url is not None, prices=settings.usd_per_replica_hour,
        summed=group.metrics if group is not None else None,
    )  # fmt: skip
    store = PolicyStore.connect(settings.store.url, settings.store.prefix) if settings.store.url else None
    control = PolicyControl(
        metrics, settings.policy, store, settings.store.cache, settings.store.refresh_s, settings.profiles, fleet
    )
    admission = AdmissionControl(fleet, metrics)
    clients = Clients(settings.auth.keys) if settings.auth.enabled else None
    mover = partial(_move, settings, fleet, store) if settings.launch and store else None
    advisor = Advisor(
        settings.advisor, partial(_split, fleet), lambda: control.plan.profile, settings.profiles,
        lambda: control.current.document.switching, mover,
    )  # fmt: skip
    window = advisor.window if settings.advisor.enabled else None  # nothing to record for, off
    tracer = Tracer(settings.tracing, probes) if settings.tracing.otlp_url is not None else None
    connections = Connections(settings.timeouts.connect_s)
    relay = Relay(settings, fleet, connections, session, metrics, control, admission, clients, window, tracer)
    metrics.advise(advisor)
    app[SESSION], app[FLEET], app[METRICS], app[RELAY], app[POLICY] = session, fleet, metrics, relay, control
    app[ADVISOR] = advisor
    discovery = _discovery(settings)
    if discovery is not None:  # the replicas found now, before serving (a source that hangs: without them)
        with contextlib.suppress(TimeoutError):
            fleet.reconcile(await asyncio.wait_for(discovery.find(), timeout=10.0))
    # One round of scrapes before serving, so a gateway in front of live replicas is ready at once.
    await asyncio.gather(*(fleet.scrape_once(probes, r) for r in fleet.replicas.values()))
    scrapers = _Scrapers(fleet, probes)
    scrapers.start(fleet.replicas.values())
    tasks = []
    if discovery is not None:
        tasks.append(asyncio.create_task(discovery.run(partial(_found, fleet, scrapers)), name="discovery"))
    tasks.append(asyncio.create_task(admission.run(), name="admission"))
    if tracer is not None:
        tasks.append(asyncio.create_task(tracer.run(), name="tracing"))
    if settings.advisor.enabled:
        tasks.append(asyncio.create_task(advisor.run(), name="advisor"))
    exchange = None
    if shared is not None and settings.store.url is not None and settings.store.exchanges and shared.index == 0:
        fleet_settings = settings.fleet
        exchange = CountExchange(
            settings.store.url, settings.store.prefix, shared, (fleet_settings.rate_window_s,
            fleet_settings.burst_window_s), settings.store.exchange, metrics.exchange_failed,
        )  # fmt: skip
        tasks.append(asyncio.create_task(exchange.run(), name="count-exchange"))
    if store is not None:
        # Read the store once before serving (briefly: Redis down must not stop the gateway).
        with contextlib.suppress(*STORE_ERRORS, TimeoutError):
            await asyncio.wait_for(control.resync(), timeout=2.0)
        tasks.append(asyncio.create_task(control.follow(), name="policy-store"))
        if clients is not None:
            tasks.append(asyncio.create_task(follow_keys(clients, settings, store), name="client-keys"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await scrapers.close()
        if discovery is not None:
            await discovery.close()
        if store is not None:
            await store.close()
        if exchange is not None:
            await exchange.close()
        connections.close()
        await session.close()
        await probes.close()
        advisor.close()
        if shared is not None:
            shared.close()


class _Scrapers:
    """A scraping task per replica of the fleet, started when it joins and stopped when it goes."""

    def __init__(self, fleet: Fleet, probes: aiohttp.ClientSession) -> None:
        self.fleet, self.probes = fleet, probes
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, replicas: Iterable[Replica]) -> None:
        for r in replicas:
            self.tasks[r.name] = asyncio.create_task(self.fleet.scrape_forever(self.probes, r), name=f"scrape-{r.name}")

    def stop(self, replicas: Iterable[Replica]) -> None:
        for r in replicas:
            task = self.tasks.pop(r.name, None)
            if task is not None:
                task.cancel()

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _shared_counts(settings: GatewaySettings) -> SharedCounts | None:
    """Where this gateway's processes count their requests (`workers/shared.py`), with a row for
    the other gateways' counts when it exchanges them through Redis; None for one process alone."""
    group, others = settings.processes, settings.store.exchanges
    if group is not None:
        return SharedCounts(group.counts, group.count, group.index, others)
    if not others:
        return None
    path = SharedCounts.create(1, others=True)
    try:
        return SharedCounts(path, 1, 0, others=True)
    finally:
        path.unlink()  # (mapped, it lives as long as the gateway)


def _discovery(settings: GatewaySettings) -> Discovery | None:
    """What finds the pools' replicas again and again, when the config names a DNS name or a label
    selector for one."""
    if not settings.discovery:
        return None
    pools = {pool: PoolSources(settings.pools.get(pool, ()), tuple(source(w) for w in settings.discovery.get(pool, ())))
             for pool in Pool}  # fmt: skip
    return Discovery(pools, settings.discovery_interval_s)


def _found(fleet: Fleet, scrapers: _Scrapers, urls: dict[Pool, list[str]]) -> None:
    joined, removed = fleet.reconcile(urls)
    scrapers.stop(removed)
    scrapers.start(joined)


def _split(fleet: Fleet) -> tuple[int, int]:
    """The fleet's speculative and plain replicas."""
    pools = [r.pool for r in fleet.replicas.values()]
    return pools.count(Pool.SPECULATIVE), pools.count(Pool.PLAIN)


SWITCH_LOCK_S = 3600.0
"""How long one gateway's switch keeps the others from starting one (it lets go when done)."""


async def _move(settings: GatewaySettings, fleet: Fleet, store: PolicyStore, step: int) -> None:
    """The advisor's move: one server of the shrinking pool, the least busy this gateway launched
    the config of, restarted in the other mode (unless another gateway is switching one now)."""
    assert settings.launch is not None
    to = Pool.SPECULATIVE if step > 0 else Pool.PLAIN
    servers = {s.url: s.name for s in settings.launch.servers}
    candidates = sorted(
        (r for r in fleet.replicas.values() if r.pool is to.other and not r.drained and r.url in servers),
        key=lambda r: r.in_flight,
    )
    if not candidates:
        _log.warning("advisor: no server of the %s pool to switch", to.other.value)
        return
    holder = f"{socket.gethostname()}:{os.getpid()}"
    with contextlib.suppress(*STORE_ERRORS):
        if not await store.lock("switching", holder, SWITCH_LOCK_S):
            return  # another gateway is switching a server
        switcher = Switcher(settings.launch, store, settings.policy, settings.profiles)
        name = servers[candidates[0].url]
        _log.info("advisor: switching %s to the %s pool", name, to.value)
        try:
            await switcher.switch(name, to)
        except SwitchError as exc:
            _log.error("advisor: switching %s failed: %s", name, exc)
        finally:
            await store.unlock("switching", holder)


async def follow_keys(clients: Clients, settings: GatewaySettings, store: PolicyStore) -> None:
    """Until cancelled: the client keys in Redis, merged over the configured ones, re-read as
    often as the policy."""
    while True:
        with contextlib.suppress(*STORE_ERRORS, TimeoutError):
            entries = await asyncio.wait_for(store.client_keys(), timeout=settings.store.refresh_s)
            try:
                keys = parse_keys(list(entries.values()), "redis clients")
            except Invalid as exc:
                _log.error("client keys in the store are invalid, keeping the current ones: %s", exc)
            else:
                clients.replace_keys(merged(settings.auth.keys, keys))
        await asyncio.sleep(settings.store.refresh_s)


async def _drain(app: web.Application) -> None:
    """On the way out (no new connections accepted any more): requests in flight get the shutdown
    grace period to finish, then are answered with a 503 or an error event ending their stream."""
    if RELAY in app:
        await app[RELAY].drain(app[SETTINGS].shutdown_grace_s)


async def _server_header(_: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER


def make_app(settings: GatewaySettings) -> web.Application:
    app = web.Application(middlewares=[openai_errors(_count_error)], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_resources)
    app.on_shutdown.append(_drain)
    app.on_response_prepare.append(_server_header)
    add_routes(app)
    if settings.admin_token is not None:
        add_admin_routes(app)
    return app


def _count_error(request: web.Request, status: int, code: str) -> None:
    """An error the gateway answered with, in `specgate_requests_total` (not the admin API's)."""
    if not request.path.startswith("/admin/"):
        _count_refused(request.app, status, code)


def _count_refused(app: web.Application, status: int, code: str) -> None:
    metrics = app.get(METRICS)
    if metrics is not None:  # (none before the gateway's resources are up)
        metrics.requests.labels("none", code, str(status)).inc()


def make_runner(app: web.Application, settings: GatewaySettings) -> GuardedRunner:
    """The runner that serves the gateway, with its connection limits."""
    limits = settings.limits
    return GuardedRunner(
        app,
        limits,
        partial(_count_refused, app),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=settings.shutdown_grace_s,
        keepalive_timeout=limits.idle_timeout_s,
        lingering_time=1.0,  # the unread rest of a body answered early (404, 413) is awaited this long
        max_line_size=limits.max_line_bytes,
        max_field_size=limits.max_header_bytes,
        max_headers=limits.max_headers,
    )


async def serve(settings: GatewaySettings, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until cancelled; on the way out, stop accepting and let requests in flight finish."""
    app = make_app(settings)
    runner = make_runner(app, settings)
    await serve_until_cancelled(
        app, settings.host, settings.port, on_ready, settings.shutdown_grace_s, runner,
        reuse_port=settings.processes is not None,
    )  # fmt: skip
