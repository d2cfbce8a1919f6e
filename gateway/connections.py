"""The gateway's keep-alive HTTP/1.1 connections to its replicas, for the requests it relays.

A general HTTP client does much per request that a relay does not need (cookie jars, redirects,
auto headers, tracing hooks, a reader per body): measured in front of a fast upstream it cost about
as much CPU as everything else the gateway does together. The relay needs one thing: a POST sent on
a pooled connection, and its answer's status, headers and body as they arrive. This module is that,
on asyncio's transports with the `httptools` parser (C, the one uvicorn runs on), with back-pressure:
a body the client reads slowly pauses the replica's socket instead of piling up in memory.

Idle connections are kept per host for `keepalive_s`, shorter than the servers' own keep-alive
(uvicorn, under vLLM, closes after 5 s), so that a request is not sent on a connection the server
is closing. Closing a response before its end closes its connection: vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

HIGH_WATER = 256 << 10
"""Bytes of body received but not yet read past which the replica's socket is paused."""
MAX_HEAD_BYTES = 64 << 10
"""A response head longer than this is not one."""
KEEPALIVE_S = 4.0
MAX_HOSTS = 4096
"""Base URLs whose parts are kept parsed."""


class UpstreamError(Exception):
    """The replica broke the exchange: no answer, a malformed one, or one cut short."""


class ConnectFailed(UpstreamError):
    """No connection to the replica could be made."""


_Key = tuple[str, str, int]
"""(scheme, host, port) of a pool of connections."""


class _Connection(asyncio.Protocol):
    """One connection, carrying one exchange at a time; `httptools` calls its `on_*` methods."""

    def __init__(self, owner: Connections, key: _Key, loop: asyncio.AbstractEventLoop) -> None:
        self.owner = owner
        self.key = key
        self.loop = loop
        self.pool: list[_Connection] | None = None
        """The idle connections to its host it is kept among, while it is."""
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None
        self._head_size = 0
        """Bytes received of the answer while its head is not complete yet."""

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's are not its subclasses)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # A callback's own refusal comes wrapped: its reason is the context.
            reason = exc.__context__ if isinstance(exc.__context__, UpstreamError) else exc
            response.fail(UpstreamError(f"malformed response: {reason}"))
            self.abort()
            return
        if not response.status:  # the parser holds what it has of the head: bounded here
            self._head_size += len(data)
            if self._head_size > MAX_HEAD_BYTES:
                response.fail(UpstreamError(f"malformed response: a head past {MAX_HEAD_BYTES} bytes"))
                self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.pool is not None and self in self.pool:
            self.pool.remove(self)
        response, self.response = self.response, None
        if response is not None:
            response.lost(exc)

    # httptools

    def on_message_begin(self) -> None:
        if self.response is None or self.response.status:
            raise UpstreamError("bytes past the end of the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.raw_headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        assert self.response is not None
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self.response.raw_headers.clear()
            return
        self.response.started(status)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.received(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is None or not response.status:
            return
        response.complete(keep_alive=self.parser.should_keep_alive())

    # the pool's side

    def send(self, head: bytes, body: bytes, response: UpstreamResponse) -> None:
        assert self.transport is not None
        self.response = response
        self._head_size = 0
        self.transport.writelines((head, body))

    def reusable(self, now: float, keepalive_s: float) -> bool:
        return self.transport is not None and not self.transport.is_closing() and now - self.idle_since < keepalive_s

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def pause(self, paused: bool) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()


class UpstreamResponse:
    """A replica's answer as it arrives: status and headers first, then the body by `readany`."""

    def __init__(self, connection: _Connection) -> None:
        self._connection: _Connection | None = connection
        self._loop = connection.loop  # (asyncio's look-up of it is a system call on Python 3.11)
        self.status = 0
        self.raw_headers: list[tuple[str, str]] = []
        self._headers: CIMultiDictProxy[str] | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._done = False
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict(self.raw_headers))
        return self._headers

    @property
    def content_type(self) -> str:
        """The media type of the body, lower-cased, without its parameters."""
        value = self.headers.get("Content-Type")
        if value is None:
            return "application/octet-stream"
        return value.partition(";")[0].strip().lower()

    # told by the connection

    def started(self, status: int) -> None:
        self.status = status
        self._wake()

    def received(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self._connection is not None:
            self._paused = True
            self._connection.pause(True)
        self._wake()

    def complete(self, *, keep_alive: bool) -> None:
        self._done, self._keep_alive = True, keep_alive
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if self._error is None and not self._done:
            self._error = error
        self._wake()

    def lost(self, exc: Exception | None) -> None:
        self._connection = None
        if self._done:
            return
        if self.status and not self._framed():  # a body delimited by the connection's end
            self._done = True
        else:
            self.fail(UpstreamError(f"connection lost: {exc!r}" if exc else "the replica closed the connection"))
        self._wake()

    def _framed(self) -> bool:
        headers = self.headers
        return "Content-Length" in headers or "chunked" in headers.get("Transfer-Encoding", "").lower()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        await self._waiter

    # read by the relay

    async def start(self) -> None:
        """Until the status and headers are in."""
        while not self.status:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def readany(self) -> bytes:
        """What of the body has arrived (waiting for some); b"" at its end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self._connection is not None:
                self._connection.pause(False)
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.readany():
            yield data

    def release(self) -> None:
        """Done with it: its connection goes back to the pool if the answer ended cleanly, else closes."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.response = None
        if self._done and self._keep_alive and self._error is None and not self._chunks:
            connection.owner.idle(connection)
        else:
            connection.abort()

    def close(self) -> None:
        """Give up on the answer: its connection closes (vLLM then aborts the request)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.response = None
            connection.abort()


class Connections:
    """Pools of keep-alive connections, one per replica host, for POSTs to the replicas."""

    def __init__(self, connect_timeout_s: float | None, keepalive_s: float = KEEPALIVE_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._pools: dict[_Key, list[_Connection]] = {}
        self._hosts: dict[str, tuple[_Key, str, str]] = {}
        """Per base URL: its pool's key, the Host header, and its path prefix."""
        self._tls: ssl.SSLContext | None = None
        self._sweep: asyncio.TimerHandle | None = None

    async def post(self, base_url: str, path: str, body: bytes, headers: CIMultiDict[str]) -> UpstreamResponse:
        """Send a POST to `base_url` + `path` with `headers` (without Host and Content-Length: this
        sets them; Content-Type is JSON unless they say); its answer once its status and headers are in.
        Raises ConnectFailed when no connection could be made, UpstreamError when the replica
        broke the exchange before its head was in."""
        key, host, prefix = self._where(base_url)
        connection = await self._connection(key)
        lines = [f"POST {prefix}{path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        if "Content-Type" not in headers:
            lines.append("Content-Type: application/json\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        response = UpstreamResponse(connection)
        connection.send(head, body, response)
        try:
            await response.start()
        except BaseException:
            response.close()
            raise
        return response

    def _where(self, base_url: str) -> tuple[_Key, str, str]:
        where = self._hosts.get(base_url)
        if where is None:
            if len(self._hosts) >= MAX_HOSTS:  # replicas come and go (discovery): forget the old ones
                self._hosts.clear()
            parts = urlsplit(base_url)
            scheme, hostname = parts.scheme, parts.hostname or ""
            port = parts.port or (443 if scheme == "https" else 80)
            host = parts.netloc.rpartition("@")[2]
            where = self._hosts[base_url] = ((scheme, hostname, port), host, parts.path.rstrip("/"))
        return where

    async def _connection(self, key: _Key) -> _Connection:
        pool = self._pools.get(key, [])
        now = time.monotonic()
        while pool:
            connection = pool.pop()
            connection.pool = None
            if connection.reusable(now, self.keepalive_s):
                return connection
            connection.abort()
        scheme, host, port = key
        tls = self._context() if scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(self, key, loop), host, port, ssl=tls)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc!r}") from None
        return connection

    def idle(self, connection: _Connection) -> None:
        """Keep a connection whose exchange ended cleanly for the next request to its host."""
        connection.idle_since = time.monotonic()
        connection.pool = self._pools.setdefault(connection.key, [])
        connection.pool.append(connection)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._close_idle)

    def _close_idle(self) -> None:
        """Close the connections idle for `keepalive_s`: one timer for all, while any are kept."""
        self._sweep = None
        now, kept = time.monotonic(), 0
        for pool in self._pools.values():
            for connection in [c for c in pool if not c.reusable(now, self.keepalive_s)]:
                pool.remove(connection)
                connection.pool = None
                connection.abort()
            kept += len(pool)
        for key in [key for key, pool in self._pools.items() if not pool]:  # hosts gone, or idle a while
            del self._pools[key]
        if kept:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s / 2, self._close_idle)

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def close(self) -> None:
        """Close every idle connection (those in use close with their answers)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for pool in self._pools.values():
            for connection in list(pool):
                connection.pool = None
                connection.abort()
            pool.clear()
