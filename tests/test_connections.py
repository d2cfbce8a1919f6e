"""The relay's connections to the replicas: keep-alive, framing, back-pressure, and replicas that lie."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from multidict import CIMultiDict

from specgate.gateway.connections import HIGH_WATER, ConnectFailed, Connections, UpstreamError

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A raw TCP server: each test writes the exact bytes a replica answers with."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.connections = 0
        self.requests: list[bytes] = []
        self.disconnected = asyncio.Event()
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.disconnected.set()
            writer.close()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """One request, head and body (by its Content-Length)."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        whole = head + await reader.readexactly(length)
        self.requests.append(whole)
        return whole


def answer(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return head + b"".join(h + b"\r\n" for h in extra) + b"\r\n" + body


@contextlib.asynccontextmanager
async def pool(keepalive_s: float = 4.0) -> AsyncIterator[Connections]:
    connections = Connections(connect_timeout_s=1.0, keepalive_s=keepalive_s)
    try:
        yield connections
    finally:
        connections.close()


async def read_all(connections: Connections, url: str, path: str = "/v1/x", body: bytes = b"{}") -> tuple[int, bytes]:
    response = await connections.post(url, path, body, CIMultiDict({"X-Request-Id": "r1"}))
    data = b"".join([chunk async for chunk in response.iter_any()])
    response.release()
    return response.status, data


async def test_answers_in_turn_share_one_connection() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.request(reader)
            writer.write(answer(b'{"ok": true}'))
            await writer.drain()

    async with Server(serve) as server, pool() as connections:
        for _ in range(3):
            assert await read_all(connections, server.url) == (200, b'{"ok": true}')
        assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"\r\nContent-Length: 2\r\n" in first
    assert b"\r\nX-Request-Id: r1\r\n" in first
    assert b"\r\nContent-Type: application/json\r\n" in first  # the body is JSON: said when the client did not
    assert first.endswith(b"\r\n\r\n{}")


async def test_a_base_url_with_a_path_keeps_it_and_its_host() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(answer(b"{}"))

    async with Server(serve) as server, pool() as connections:
        await read_all(connections, server.url + "/tenant-a")
    host = server.url.removeprefix("http://").encode()
    assert server.requests[0].startswith(b"POST /tenant-a/v1/x HTTP/1.1\r\nHost: " + host + b"\r\n")


async def test_a_chunked_stream_arrives_as_it_is_sent() -> None:
    go_on = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()

    async with Server(serve) as server, pool() as connections:
        response = await connections.post(server.url, "/v1/x", b"{}", CIMultiDict())
        assert response.content_type == "text/event-stream"
        assert await response.readany() == b"data: 1"  # before the replica sent the rest
        go_on.set()
        assert await response.readany() == b"data: 2"
        assert await response.readany() == b""
        response.release()


async def test_a_body_ended_by_closing_the_connection_is_whole() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async with Server(serve) as server, pool() as connections:
        assert await read_all(connections, server.url) == (200, b"all of it")


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",  # cut short
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # no last chunk
        b"SPDY/9 banana\r\n\r\n",  # not HTTP
        b"HTTP/1.1 200 OK\r\nContent-Length: zero\r\n\r\n",  # a length that is not one
        b"",  # closed at once
    ],
)
async def test_a_replica_that_breaks_the_exchange_raises_an_upstream_error(reply: bytes) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(reply)
        await writer.drain()

    async with Server(serve) as server, pool() as connections:
        with pytest.raises(UpstreamError):
            await read_all(connections, server.url)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-Filler-%d: %s\r\n" % (i, b"y" * 64) for i in range(10_000)),
        b"HTTP/1.1 200 OK\r\nX-Endless: " + b"y" * 200_000,  # one header line without end
    ],
)
async def test_a_head_without_end_is_refused_not_buffered(head: bytes) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(head)
        await writer.drain()
        await reader.read()  # until the gateway hangs up

    async with Server(serve) as server, pool() as connections:
        with pytest.raises(UpstreamError, match="head past"):
            await asyncio.wait_for(read_all(connections, server.url), 3.0)


async def test_no_replica_listening_is_a_connect_failure() -> None:
    async with Server(lambda r, w: asyncio.sleep(0)) as server:
        url = server.url
    async with pool() as connections:
        with pytest.raises(ConnectFailed):
            await read_all(connections, url)


async def test_bytes_past_the_end_of_an_answer_retire_its_connection() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.request(reader)
            writer.write(answer(b"{}") + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    async with Server(serve) as server, pool() as connections:
        assert await read_all(connections, server.url) == (200, b"{}")
        await asyncio.sleep(0.05)
        assert await read_all(connections, server.url) == (200, b"{}")
        assert server.connections == 2  # the answer after the end was nobody's: a fresh connection


async def test_a_connection_the_replica_closed_or_idle_too_long_is_not_reused() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(answer(b"{}"))  # keep-alive said, then closed: as a server whose idle timeout passed
        await writer.drain()

    async with Server(serve) as server, pool() as connections:
        for _ in range(3):
            assert await read_all(connections, server.url) == (200, b"{}")
            await asyncio.sleep(0.05)
        assert server.connections == 3

    async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await kept.request(reader)
            writer.write(answer(b"{}"))
            await writer.drain()

    async with Server(keep) as kept, pool(keepalive_s=0.05) as connections:
        await read_all(connections, kept.url)
        await asyncio.sleep(0.1)
        await read_all(connections, kept.url)
        assert kept.connections == 2


async def test_a_slow_reader_pauses_the_replica_instead_of_buffering() -> None:
    sent = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await server.request(reader)
        size = 32 << 20
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        block = b"x" * (64 << 10)
        while sent < size:
            writer.write(block)
            await writer.drain()
            sent += len(block)

    async with Server(serve) as server, pool() as connections:
        response = await connections.post(server.url, "/v1/x", b"{}", CIMultiDict())
        await asyncio.sleep(0.5)  # the client reads nothing meanwhile
        assert sent < 8 << 20  # the replica was held back by the socket, not drained into memory
        biggest = received = 0
        while data := await response.readany():
            biggest = max(biggest, len(data))
            received += len(data)
        response.release()
    assert received == 32 << 20
    assert biggest <= HIGH_WATER + (1 << 20)


async def test_closing_an_answer_midway_hangs_up_on_the_replica() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await reader.read()  # until the gateway hangs up

    async with Server(serve) as server, pool() as connections:
        response = await connections.post(server.url, "/v1/x", b"{}", CIMultiDict())
        assert await response.readany() == b"hello"
        response.close()
        await asyncio.wait_for(server.disconnected.wait(), 2.0)


async def test_cancelled_while_waiting_for_the_head_hangs_up() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        await reader.read()

    async with Server(serve) as server, pool() as connections:
        task = asyncio.create_task(connections.post(server.url, "/v1/x", b"{}", CIMultiDict()))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.disconnected.wait(), 2.0)


async def test_idle_connections_close_on_their_own() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(answer(b"{}"))
        await writer.drain()
        await reader.read()  # until the gateway hangs up

    async with Server(serve) as server, pool(keepalive_s=0.1) as connections:
        await read_all(connections, server.url)
        await asyncio.wait_for(server.disconnected.wait(), 1.0)  # no request came to close it


async def test_a_connection_busy_while_its_host_was_swept_is_kept_for_the_next_request() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await server.request(reader)
            if b"/slow" in request.split(b"\r\n", 1)[0]:
                await asyncio.sleep(0.3)  # the idle connections are swept meanwhile (none left)
            writer.write(answer(b"{}"))
            await writer.drain()

    async with Server(serve) as server, pool(keepalive_s=0.1) as connections:
        await read_all(connections, server.url)
        await read_all(connections, server.url, "/slow")
        await read_all(connections, server.url)
        assert server.connections == 1
