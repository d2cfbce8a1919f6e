"""The gateway's HTTP server, hardened: sockets cannot be exhausted, and even a request too broken
to reach a handler gets its answer in the OpenAI error shape.

- A connection must deliver a whole request head (request line and headers) within
  `header_timeout_s` of opening, or of its previous request ending (after `idle_timeout_s` of
  silence between requests it is closed): a slow sender (slowloris) holds a socket for seconds,
  not an hour; its body is due within `body_timeout_s` more (408 after).
- At most `max_connections` connections at once; the one past it is answered 503 and closed.
- Request heads too large or malformed are answered 414 (URL), 431 (headers) or 400, and
  internal errors 500, all as `{"error": {...}}`, never aiohttp's plain text.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from specgate.gateway.errors import SERVER, http_error_response

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float = 10.0
    """To deliver a request's line and headers."""
    body_timeout_s: float = 60.0
    """To deliver a request's body once its headers arrived: longer is 408."""
    idle_timeout_s: float = 75.0
    """Silence allowed on a kept-alive connection between two requests."""
    max_connections: int = 4096
    """Client connections at once (capped below the process's file limit at start)."""
    max_line_bytes: int = 8190
    """The request line (the URL): longer is 414."""
    max_header_bytes: int = 8190
    """One header: longer is 431."""
    max_headers: int = 128
    """Headers in a request: more is 431."""


Refused = Callable[[int, str], None]
"""Told of each answer the server gives itself, before any handler: its status and error code."""


def _error(status: int, message: str, kind: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


def _classify(exc: BaseException | None, status: int) -> tuple[int, str, str]:
    """(status, message, code) for a request the parser refused."""
    if isinstance(exc, LineTooLong):
        line = exc.args[0] if exc.args else b""
        first = line[:1].encode() if isinstance(line, str) else bytes(line[:1])
        if first == b"/":  # the request target: the URL
            return 414, "the request URL is too long", "uri_too_long"
        return 431, "a request header is too large", "header_too_large"
    if isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc):
        return 431, "too many request headers", "header_too_large"
    if isinstance(exc, BadHttpMessage) or (status == 400 and exc is not None):
        return 400, f"malformed HTTP request: {getattr(exc, 'message', '') or type(exc).__name__}", "bad_request"
    if status == 504:
        return 504, "the request timed out", "timeout"
    return 500, "internal gateway error", "internal_error"


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler with a deadline on request heads and OpenAI-shaped errors."""

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guarded = manager
        """`_manager`, as the server it is: its limits, and who is told of what it refuses."""
        self._limits = manager.limits
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._guarded
        if len(manager.connections) >= manager.max_connections:
            manager.refused(503, "overloaded")
            body = _error(503, "the gateway is at its connection limit; retry later", "server_error", "overloaded")
            head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            assert isinstance(transport, asyncio.Transport)
            head += b"Server: %s\r\nConnection: close\r\n" % SERVER.encode()
            transport.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self._limits.header_timeout_s)

    def _arm(self, seconds: float) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self._loop.call_later(seconds, self._head_overdue)

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self._request_in_progress or self._messages:
            return  # a request arrived whole: its handler runs
        if self.transport is not None and not self.transport.is_closing():
            self._guarded.refused(408, "request_timeout")
            body = _error(408, "the request was not received in time", "invalid_request_error", "request_timeout")
            head = b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
            head += b"Server: %s\r\n" % SERVER.encode()
            self.transport.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.force_close()
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages and self._head_timer is not None:
            self._head_timer.cancel()  # a whole request head arrived
            self._head_timer = None

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        async def guarded(request: BaseRequest) -> web.StreamResponse:
            # What aiohttp raises before the application's middleware runs (an unknown Expect: 417).
            try:
                return await request_handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return http_error_response(exc)

        try:
            return await super()._handle_request(request, start_time, guarded)
        finally:
            # The next request's head is due within the idle allowance plus the head deadline.
            if not self._force_close:
                self._arm(self._limits.idle_timeout_s + self._limits.header_timeout_s)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        code, text, kind = _classify(exc, status)
        self._guarded.refused(code, kind)
        if code == 500 and exc is not None:
            _log.error("error handling a request from %s", request.remote, exc_info=exc)
        error_type = "invalid_request_error" if code < 500 else "server_error"
        response = web.Response(
            status=code, body=_error(code, text, error_type, kind), content_type="application/json",
            headers={"Server": SERVER},
        )  # fmt: skip
        response.force_close()
        return response


class GuardedServer(web.Server):
    def __init__(self, *args: Any, limits: Limits, on_refused: Refused | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.max_connections = capped_connections(limits.max_connections)
        self.on_refused = on_refused

    def refused(self, status: int, code: str) -> None:
        """The server answered a connection or a request itself, before any handler ran."""
        if self.on_refused is not None:
            self.on_refused(status, code)

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    def __init__(self, app: web.Application, limits: Limits, on_refused: Refused | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limits = limits
        self.on_refused = on_refused

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        guarded = GuardedServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            limits=self.limits,
            on_refused=self.on_refused,
            **server._kwargs,
        )
        return guarded


def capped_connections(wanted: int) -> int:
    """`wanted`, within what the process may open: its file limit raised to the hard limit if it
    can be, and half of it kept for the connections to the replicas and everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(min(wanted, soft // 2), 16)
