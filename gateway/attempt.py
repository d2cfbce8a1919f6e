"""One attempt: one request sent to one replica, and its answer relayed to the client.

An attempt that fails before any byte reached the client raises `RetryElsewhere`, and the relay
decides whether another replica gets the request. Health is judged here, on the replica's own
socket only: a client that leaves mid-answer closes the upstream request (vLLM aborts it and
frees its KV cache) and is never counted against the replica.

A stream is relayed event by event as it arrives: bytes are passed on up to the last complete
SSE event, and an unfinished event waits for its end. If the replica fails mid-stream the attempt
raises `StreamBroke` with what the client has, and the relay either continues the answer on
another replica (see `continuation`) or ends it with a well-formed error event.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from specgate.gateway.config import Timeouts
from specgate.gateway.connections import ConnectFailed, Connections, UpstreamError, UpstreamResponse
from specgate.gateway.continuation import ClientStream, Continuation, count_tokens, shutting_down
from specgate.gateway.errors import GatewayError, UpstreamBusy, UpstreamTimeout, UpstreamUnavailable
from specgate.gateway.journey import Journey, handler_task, hop_by_hop
from specgate.gateway.sla import REQUEST_ID
from specgate.policies.decision import Decision
from specgate.policies.length import LengthStats
from specgate.protocol.tokens import completion_tokens
from specgate.workers.pools import Replica, Stay

MAX_ANSWER_BYTES = 64 << 20
"""A whole (not streamed) answer longer than this is not an answer."""
MAX_HELD_BYTES = 1 << 20
"""An SSE event longer than this is passed on unfinished: the stream is not SSE after all."""
CLIENT_GONE = 499
"""The status recorded for a request whose client left before its answer ended (nginx's code)."""
SHUT_DOWN = 503
"""The status recorded for a request cut because the gateway shut down."""
_CLIENT_WRITE_ERRORS = (ConnectionError, RuntimeError)
"""What writing to a client that left raises (aiohttp: ClientConnectionResetError, a
ConnectionResetError; RuntimeError on a closed transport)."""


class RetryElsewhere(Exception):
    """The attempt failed before any byte reached the client: another replica may serve it."""

    def __init__(self, error: GatewayError, *, withdrawn: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.withdrawn = withdrawn
        """The gateway gave up on the replica itself (ejected meanwhile): the request moves, it is
        not retried after a failure of its own."""


class StreamBroke(Exception):
    """The replica failed after the client's stream had begun: the stream is still open."""

    def __init__(self, stream: ClientStream, *, resumable: bool = True) -> None:
        super().__init__("the stream broke")
        self.stream = stream
        self.resumable = resumable
        """False when no other replica can go on with it (the continuation itself was refused)."""


@dataclass
class Outcome:
    """What one attempt learned, for the feedback after the response is done."""

    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    streamed: bool = False
    completion_tokens: int | None = None
    """As the answer's usage says; None without one (a stream that did not ask for it)."""
    generated: int = 0
    """Tokens it generated: the usage's count, else, streamed, one a content event (a speculative
    replica's events carry several: a lower bound there)."""
    stay: Stay | None = None
    """When it was sent to the replica, and how loaded that was (for the step-cost fit)."""
    ended: float = 0.0
    """When the replica was done with it (monotonic clock)."""
    step_s: float | None = None
    """The median time between the stream's reads after the first: one engine step each, as
    vLLM sends an event a step (more when it is too busy to send each)."""


class Attempt:
    def __init__(
        self,
        journey: Journey,
        replica: Replica,
        decision: Decision,
        connections: Connections,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        lengths: LengthStats,
        *,
        last: bool,
        resuming: tuple[ClientStream, Continuation] | None = None,
    ) -> None:
        self.journey = journey
        self.replica = replica
        self.decision = decision
        self.connections = connections
        self.session = session
        """For the replica's tokenizer, when a stream goes on from another replica's."""
        self.timeouts = timeouts
        self.lengths = lengths
        """Learns the request's output length in the order answers began (`policies/length.py`)."""
        self.last = last
        """No other replica will be tried: a 5xx goes to the client as it is."""
        self.resuming = resuming
        """The client's stream this attempt continues, and how; None for a fresh request."""
        self.outcome = Outcome()
        self.stream: ClientStream | None = None
        """The client's stream, once it began."""
        self.started = 0.0
        self._got_first_byte = False

    @property
    def waited_s(self) -> float:
        """What the request waited in the gateway before this attempt was sent (the admission
        queue, earlier attempts): part of the TTFT its client sees."""
        return self.started - self.journey.arrived

    async def run(self) -> web.StreamResponse:
        """The client's response; `RetryElsewhere` when another replica may serve it instead,
        `StreamBroke` when the replica failed after the client's stream began."""
        replica, prompt, stream = self.replica, self.journey.features.prompt_tokens, self.journey.features.stream
        self.started = time.monotonic()
        body = await self._body()
        self.outcome.stay = replica.dispatched_one(prompt, self.started, stream=stream)
        if not stream:  # its first token is not seen: it began, as far as the gateway knows, when sent
            self.lengths.start(self.journey.length, self.started)
        watchdog = Watchdog(self.timeouts.first_byte_s, self.timeouts.idle_s, handler_task(self.journey.request))
        replica.waiting.add(watchdog.fire)  # ejected meanwhile (hung, say): go elsewhere
        try:
            try:
                upstream = await self._send(body, watchdog)
            finally:
                replica.waiting.discard(watchdog.fire)
            self._got_first_byte = True
            watchdog.started()
            replica.first_byte(prompt, stream=stream)
            replica.streaming.add(watchdog.fire)  # found hung meanwhile: go on elsewhere
            try:
                response = await self._answer(upstream, watchdog)
            except BaseException:
                upstream.close()
                raise
            finally:
                replica.streaming.discard(watchdog.fire)
            upstream.release()
            if upstream.status < 500 and upstream.status != 429 and self.outcome.status < 500:
                replica.succeeded()  # (a 5xx was counted as its failure on arrival)
            return response
        except asyncio.CancelledError as cancel:  # the client left, or the gateway is shutting down
            self.outcome.status = SHUT_DOWN if shutting_down(cancel) else CLIENT_GONE
            raise
        finally:
            watchdog.stop()
            self.outcome.ended = time.monotonic()
            replica.finished(got_first_byte=self._got_first_byte, prompt_tokens=prompt, now=self.outcome.ended)

    async def _body(self) -> bytes:
        """The request body for this replica: the client's, or the continuation of its stream."""
        if self.resuming is None:
            return self.journey.raw
        stream, continuation = self.resuming
        done = continuation.progress
        tokens = await count_tokens(
            self.session, self.replica.url, self.journey.fields.model, done.text, done.content_events
        )
        body = continuation.request_body(tokens)
        if body is None:  # the answer had used up its tokens: nothing left to ask for
            raise StreamBroke(stream, resumable=False)
        return body

    async def _answer(self, upstream: UpstreamResponse, watchdog: Watchdog) -> web.StreamResponse:
        replica, status = self.replica, upstream.status
        if status >= 500:
            replica.failed(f"answered {status}")
        elif status == 429:  # busy, not broken: no failure of its health, but a rest
            replica.busy(_retry_after_s(upstream.headers))
        if self.resuming is not None and (status != 200 or upstream.content_type != "text/event-stream"):
            # The client's stream is open: only another stream can go on with it.
            if (status >= 500 or status == 429) and not self.last:
                raise RetryElsewhere(UpstreamUnavailable(f"replica {replica.name} answered {status}"))
            self.outcome.status = 502
            raise StreamBroke(self.resuming[0], resumable=False)
        if status >= 500 and not self.last:
            raise RetryElsewhere(UpstreamUnavailable(f"replica {replica.name} answered {status}"))
        if status == 429 and not self.last:
            raise RetryElsewhere(UpstreamBusy(f"replica {replica.name} answered 429"))
        self.outcome.status = status
        if upstream.content_type == "text/event-stream":
            return await self._stream(upstream, watchdog)
        return await self._whole(upstream, watchdog)

    async def _send(self, body: bytes, watchdog: Watchdog) -> UpstreamResponse:
        replica, journey = self.replica, self.journey
        try:
            return await self.connections.post(replica.url, journey.endpoint.value, body, journey.upstream_headers)
        except asyncio.CancelledError:
            if not watchdog.absorb():
                raise
            withdrawn = not replica.healthy  # ejected meanwhile, which fired this
            if not withdrawn:  # its own failure
                replica.failed("no first byte in time")
            error = UpstreamTimeout(f"replica {replica.name} sent nothing in time")
            if self.last and self.resuming is None and not withdrawn:
                raise error from None
            raise RetryElsewhere(error, withdrawn=withdrawn) from None
        except ConnectFailed as exc:
            replica.failed(f"connect failed: {exc}", eject=True)
            raise RetryElsewhere(UpstreamUnavailable(f"replica {replica.name} could not be reached")) from None
        except UpstreamError as exc:
            replica.failed(f"request failed: {exc}")
            raise RetryElsewhere(UpstreamUnavailable(f"replica {replica.name} failed before answering")) from None

    def _route_headers(self) -> dict[str, str]:
        decision, replica, journey = self.decision, self.replica, self.journey
        route = {
            "x-route-pool": replica.pool.value,
            "x-route-replica": replica.name,
            "x-route-reason": decision.reason,
            "x-policy-version": journey.plan.version,
            REQUEST_ID: journey.headers.request_id,
        }
        if decision.predicted_ttft_ms is not None:
            # The TTFT its client will see: the wait in the gateway, then this replica's first token.
            route["x-predicted-ttft-ms"] = f"{self.waited_s * 1e3 + decision.predicted_ttft_ms:.1f}"
        if decision.predicted_tpot_ms is not None:
            route["x-predicted-tpot-ms"] = f"{decision.predicted_tpot_ms:.1f}"
        return route

    def _response_headers(self, upstream: UpstreamResponse) -> CIMultiDict[str]:
        route = self._route_headers()
        dropped = hop_by_hop(upstream.headers, _OURS)
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in upstream.headers.items():
            lower = name.lower()
            if lower in dropped or lower in route:
                continue
            out.add(name, value)
        out.update(route)
        return out

    async def _whole(self, upstream: UpstreamResponse, watchdog: Watchdog) -> web.Response:
        """A whole answer, read before any of it goes out: whatever fails, nothing reached the
        client, so another replica may still serve the request."""
        replica = self.replica
        error: GatewayError | None = None
        parts: list[bytes] = []
        size = 0
        try:
            async for chunk in upstream.iter_any():
                watchdog.last = replica.received_at = time.monotonic()
                parts.append(chunk)
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    replica.failed("answer past the size limit")
                    error = UpstreamUnavailable(f"replica {replica.name} sent an answer past {MAX_ANSWER_BYTES} bytes")
                    break
        except asyncio.CancelledError:
            if not watchdog.absorb():
                raise
            replica.failed("response body stalled")
            error = UpstreamTimeout(f"replica {replica.name} stopped sending its answer")
        except UpstreamError as exc:
            replica.failed(f"answer broke: {exc}")
            error = UpstreamUnavailable(f"replica {replica.name} failed while answering")
        body = b"".join(parts)
        if error is None and upstream.status == 200 and not _is_json(body):  # a replica that lies
            replica.failed("answered 200 with a body that is not JSON")
            error = UpstreamUnavailable(f"replica {replica.name} answered with a malformed body")
        if error is not None:
            raise error if self.last else RetryElsewhere(error)
        # The client sees nothing before the whole answer: its first byte is the end.
        self.outcome.ttft_s = time.monotonic() - self.started
        self.outcome.completion_tokens = completion_tokens(body)
        self.outcome.generated = self.outcome.completion_tokens or 0
        return web.Response(status=upstream.status, body=body, headers=self._response_headers(upstream))

    async def _client_stream(self, upstream: UpstreamResponse) -> ClientStream:
        if self.resuming is not None:
            self.stream = self.resuming[0]
        else:
            response = web.StreamResponse(status=upstream.status, headers=self._response_headers(upstream))
            await response.prepare(self.journey.request)
            self.stream = ClientStream(response)
        return self.stream

    async def _stream(self, upstream: UpstreamResponse, watchdog: Watchdog) -> web.StreamResponse:
        stream = await self._client_stream(upstream)
        rewrite = self.resuming[1].rewrite if self.resuming is not None else None
        self.outcome.streamed = True
        first_at = 0.0
        events = 0
        gaps: list[float] = []
        held = previous = last = b""
        try:
            while True:
                try:
                    chunk = await upstream.readany()
                except UpstreamError as exc:
                    self.replica.failed(f"stream broke: {exc}")
                    self.outcome.status = 502
                    raise StreamBroke(stream) from None
                if not chunk:
                    if held:
                        await stream.send(held if rewrite is None else rewrite(held))
                    break
                now = time.monotonic()
                if first_at:
                    gaps.append(now - watchdog.last)
                else:
                    first_at = now
                    self.lengths.start(self.journey.length, now)
                watchdog.last = self.replica.received_at = now
                events += chunk.count(b"data: ")
                previous, last = last, chunk
                ready, held = _complete_events(held + chunk)
                if ready and rewrite is not None:
                    ready = rewrite(ready)
                if ready:
                    watchdog.writing = True
                    await stream.send(ready)
                    watchdog.writing = False
            await stream.response.write_eof()
        except asyncio.CancelledError:
            if not watchdog.absorb():
                raise
            if watchdog.writing:  # the client stopped reading: its own doing, not the replica's
                self.outcome.status = CLIENT_GONE
                upstream.close()
                if self.journey.request.transport is not None:
                    self.journey.request.transport.abort()
            else:
                self.replica.failed(f"stream silent for {self.timeouts.idle_s:g} s")
                self.outcome.status = 504
                raise StreamBroke(stream) from None
        except _CLIENT_WRITE_ERRORS:
            # The client left mid-answer: not the replica's fault. Closing the upstream request
            # makes vLLM abort it.
            self.outcome.status = CLIENT_GONE
            upstream.close()
        if first_at:
            self.outcome.ttft_s = first_at - self.started
            self.outcome.completion_tokens = completion_tokens(previous + last)
            tokens = self.outcome.completion_tokens or max(events - 2, 0)
            self.outcome.generated = tokens
            if tokens > 1:
                self.outcome.tpot_s = (watchdog.last - first_at) / (tokens - 1)
            if gaps:
                self.outcome.step_s = statistics.median(gaps)
        return stream.response


_OURS = frozenset({"date", "server"})
"""Response headers the gateway's server writes itself."""
BUSY_S = 1.0
"""How long a replica that answered 429 without a Retry-After is left alone."""


def _retry_after_s(headers: CIMultiDictProxy[str]) -> float:
    """A 429's Retry-After in seconds (delay-seconds only; an HTTP date or nonsense: the default)."""
    value = headers.get("Retry-After", "").strip()
    return float(value) if value.isdigit() else BUSY_S


def _is_json(body: bytes) -> bool:
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return True


def _complete_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` split after its last complete SSE event: (what can go out, what must wait)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    if end == 0 and len(data) > MAX_HELD_BYTES:
        return data, b""
    return data[:end], data[end:]


class Watchdog:
    """Cancels an attempt whose upstream stays silent: first `first_byte_s` until the response
    starts, then `idle_s` between two chunks.

    One timer per attempt, re-armed only when it fires, instead of a timeout armed around every
    read: the relay loop just records when the last chunk came, and whether it is writing to the
    client (a silence then is the client's, who stopped reading).
    """

    def __init__(self, first_byte_s: float, idle_s: float, task: asyncio.Task[Any]) -> None:
        """Watching for the attempt run by `task` (the request's handler), which it cancels."""
        self.idle_s = idle_s
        self.last = time.monotonic()
        self.writing = False
        self._fired = False
        self._task = task
        self._loop = task.get_loop()
        self._timer = self._loop.call_later(first_byte_s, self.fire)

    def started(self) -> None:
        """The response began: from now on, watch for silence between chunks."""
        self._timer.cancel()
        self.last = time.monotonic()
        self._timer = self._loop.call_later(self.idle_s, self._check)

    def _check(self) -> None:
        silent = time.monotonic() - self.last
        if silent < self.idle_s:
            self._timer = self._loop.call_later(self.idle_s - silent, self._check)
        else:
            self.fire()

    def fire(self) -> None:
        """Give up on the upstream now, as if it had stayed silent too long (from another task, or a
        timer: a task reporting its own failure is already giving up)."""
        if not self._fired and asyncio.current_task(self._loop) is not self._task:
            self._fired = True
            self._task.cancel()

    def absorb(self) -> bool:
        """After a CancelledError: True when the watchdog caused it (the task then goes on)."""
        if not self._fired:
            return False
        self._fired = False
        self._task.uncancel()
        return True

    def stop(self) -> None:
        self._timer.cancel()
