"""Serving an aiohttp application until cancelled: shared by the gateway and the simulated replica."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

from aiohttp import web

LISTEN_BACKLOG = 4096


async def serve_until_cancelled(
    app: web.Application,
    host: str,
    port: int,
    on_ready: Callable[[str], None] | None = None,
    shutdown_timeout: float = 60.0,
    runner: web.AppRunner | None = None,
    *,
    reuse_port: bool = False,
) -> None:
    """Listen on host:port (0 picks a free port) and serve until the task is cancelled.

    `on_ready` gets the base URL once the socket listens. `runner`, when given, is one made for
    `app` (with its own limits); by default a plain aiohttp runner. A client that disconnects cancels its
    handler. On the way out the server stops accepting and lets requests in flight finish for up
    to `shutdown_timeout` seconds. With `reuse_port`, other processes may listen on the same port
    (SO_REUSEPORT): the kernel spreads the connections over them.
    """
    if runner is None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        # aiohttp's default accept backlog (128) overflows when hundreds of clients connect at
        # once, and a dropped SYN costs the client a one-second retransmit.
        site = web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG, reuse_port=reuse_port or None)
        await site.start()
        # What was built to serve (modules, profiles, tables, the app) lives as long as the server:
        # moved out of the collector's sight, a full collection walks only what requests left.
        gc.freeze()
        bound_host, bound_port = runner.addresses[0][:2]
        if on_ready is not None:
            on_ready(
                f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else f"http://{bound_host}:{bound_port}"
            )
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
