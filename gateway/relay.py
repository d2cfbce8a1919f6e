"""Forwarding one request: choose a replica, send the bytes, relay the answer as it comes.

The body goes out exactly as received. A connect failure or a 5xx before any byte reached the
client is retried once on another replica (the policy chooses again without the failed one, so
the other pool serves when the first one's pool is down). A streamed answer is relayed chunk by
chunk as it arrives; a client that leaves closes the upstream request, so vLLM aborts it and
frees its KV cache. Everything the gateway learns on the way — first-byte time, time per token,
outcome — feeds the replica's accounting and the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from specgate.gateway.body import parse_body
from specgate.gateway.config import GatewaySettings
from specgate.gateway.errors import (
    BodyTooLarge,
    GatewayError,
    NoHealthyReplica,
    Overloaded,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from specgate.gateway.metrics import GatewayMetrics
from specgate.gateway.sla import REQUEST_ID, RoutingHeaders, parse_routing_headers
from specgate.policies.decision import Decision, Shed
from specgate.policies.features import RequestFeatures
from specgate.policies.length import LengthStats
from specgate.policies.registry import RoutingPlan
from specgate.protocol.endpoints import Endpoint
from specgate.protocol.tokens import completion_tokens
from specgate.workers.pools import Fleet, Replica

# Connection-level headers (RFC 9110 section 7.6.1) and the ones aiohttp sets itself.
_HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
    }
)  # fmt: skip
_MID_STREAM_ERROR = (
    b'data: {"error": {"message": "the replica failed mid-stream", "type": "server_error", '
    b'"param": null, "code": "upstream_failed"}}\n\n'
)


@dataclass
class Outcome:
    """What one attempt learned, for accounting after the response is done."""

    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    streamed: bool = False
    completion_tokens: int | None = None


class Relay:
    def __init__(
        self,
        settings: GatewaySettings,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        plan: RoutingPlan,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.session = session
        self.metrics = metrics
        self.plan = plan
        """The plan in force; a new one is swapped in with one assignment."""
        self.lengths = LengthStats()
        self._sequence = itertools.count(1)  # 0 would make the very first request an exploration

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"request body exceeds {self.settings.max_body_bytes} bytes") from None
        fields = parse_body(raw, endpoint, self.settings.models)
        plan = self.plan  # one plan routes the whole request, even if a new one is swapped in meanwhile
        headers = parse_routing_headers(request.headers, plan.slo_for)
        features = RequestFeatures(
            model=fields.model,
            stream=fields.stream,
            prompt_tokens=fields.prompt_tokens,
            max_tokens=fields.max_tokens,
            expected_output_tokens=self.lengths.expected(
                fields.model,
                fields.prompt_tokens,
                hint=headers.expected_output_tokens,
                max_tokens=fields.max_tokens,
                request_class=headers.request_class,
            ),
            slo_ttft_ms=headers.slo_ttft_ms,
            slo_tpot_ms=headers.slo_tpot_ms,
            forced_pool=headers.forced_pool,
            priority=headers.priority,
            sequence=next(self._sequence),
        )
        upstream_headers = self._upstream_headers(request, headers.request_id)
        tried: set[str] = set()
        failure: GatewayError | None = None
        for attempt in range(2):
            snapshot = self.fleet.snapshot(time.monotonic())
            decision = plan.decide(features, snapshot.without(frozenset(tried)) if tried else snapshot)
            if decision is None:
                break
            if isinstance(decision, Shed):
                self.metrics.decisions.labels(plan.policy.name, "none", decision.reason).inc()
                self.metrics.requests.labels("none", decision.reason, "429").inc()
                raise Overloaded(
                    "no replica can meet this request's SLO now; retry later", retry_after_s=decision.retry_after_s
                )
            replica = self.fleet.replicas[decision.replica.name]
            tried.add(replica.name)
            pool = replica.pool.value
            self.metrics.decisions.labels(plan.policy.name, pool, decision.reason).inc()
            if attempt:
                self.metrics.retries.labels(pool).inc()
            result = await self._attempt(
                request,
                endpoint,
                raw,
                upstream_headers,
                replica,
                decision,
                features,
                headers,
                plan.version,
                last=attempt == 1,
            )
            if isinstance(result, GatewayError):
                failure = result
                continue
            return result
        raise failure or NoHealthyReplica("no healthy replica can take the request")

    def _upstream_headers(self, request: web.Request, request_id: str) -> CIMultiDict[str]:
        out: CIMultiDict[str] = CIMultiDict()
        for name, value in request.headers.items():
            lower = name.lower()
            if lower in _HOP_BY_HOP or lower == REQUEST_ID:
                continue
            if lower == "authorization" and not self.settings.forward_authorization:
                continue
            out.add(name, value)
        out[REQUEST_ID] = request_id
        return out

    def _route_headers(
        self, decision: Decision, replica: Replica, headers: RoutingHeaders, version: str
    ) -> dict[str, str]:
        route = {
            "x-route-pool": replica.pool.value,
            "x-route-replica": replica.name,
            "x-route-reason": decision.reason,
            "x-policy-version": version,
            REQUEST_ID: headers.request_id,
        }
        if decision.predicted_ttft_ms is not None:
            route["x-predicted-ttft-ms"] = f"{decision.predicted_ttft_ms:.1f}"
        if decision.predicted_tpot_ms is not None:
            route["x-predicted-tpot-ms"] = f"{decision.predicted_tpot_ms:.1f}"
        return route

    async def _attempt(
        self,
        request: web.Request,
        endpoint: Endpoint,
        raw: bytes,
        upstream_headers: CIMultiDict[str],
        replica: Replica,
        decision: Decision,
        features: RequestFeatures,
        headers: RoutingHeaders,
        version: str,
        *,
        last: bool,
    ) -> web.StreamResponse | GatewayError:
        timeouts = self.settings.timeouts
        outcome = Outcome()
        started = time.monotonic()
        got_first_byte = False
        replica.dispatched_one(features.prompt_tokens, started)
        watchdog = _Watchdog(timeouts.first_byte_s, timeouts.idle_s)
        try:
            try:
                upstream = await self.session.post(f"{replica.url}{endpoint.value}", data=raw, headers=upstream_headers)
            except asyncio.CancelledError:
                if not watchdog.absorb():
                    raise
                replica.failed("no first byte in time")
                raise UpstreamTimeout(
                    f"replica {replica.name} sent nothing within {timeouts.first_byte_s:g} s"
                ) from None
            except aiohttp.ClientConnectorError as exc:
                replica.failed(f"connect failed: {exc}", eject=True)
                return UpstreamUnavailable(f"replica {replica.name} could not be reached")
            except aiohttp.ClientError as exc:
                replica.failed(f"request failed: {exc!r}")
                return UpstreamUnavailable(f"replica {replica.name} failed before answering")
            got_first_byte = True
            watchdog.started()
            replica.first_byte(features.prompt_tokens)
            try:
                if upstream.status >= 500 and not last:
                    replica.failed(f"answered {upstream.status}")
                    return UpstreamUnavailable(f"replica {replica.name} answered {upstream.status}")
                route = self._route_headers(decision, replica, headers, version)
                outcome.status = upstream.status
                if upstream.content_type == "text/event-stream":
                    response = await self._stream(request, upstream, route, replica, started, outcome, watchdog)
                else:
                    response = await self._whole(upstream, route, replica, started, outcome, watchdog)
            except BaseException:
                upstream.close()
                raise
            upstream.release()
            if upstream.status >= 500:
                replica.failed(f"answered {upstream.status}")
            else:
                replica.succeeded()
            self._account(replica, decision, features, headers, outcome)
            return response
        finally:
            watchdog.stop()
            replica.finished(got_first_byte=got_first_byte, prompt_tokens=features.prompt_tokens)

    async def _whole(
        self,
        upstream: aiohttp.ClientResponse,
        route: dict[str, str],
        replica: Replica,
        started: float,
        outcome: Outcome,
        watchdog: _Watchdog,
    ) -> web.Response:
        try:
            body = await upstream.read()
        except asyncio.CancelledError:
            if not watchdog.absorb():
                raise
            replica.failed("response body stalled")
            raise UpstreamTimeout(f"replica {replica.name} stopped sending its answer") from None
        # The client sees nothing before the whole answer: its first byte is the end.
        outcome.ttft_s = time.monotonic() - started
        outcome.completion_tokens = completion_tokens(body)
        return web.Response(status=upstream.status, body=body, headers=_response_headers(upstream, route))

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        route: dict[str, str],
        replica: Replica,
        started: float,
        outcome: Outcome,
        watchdog: _Watchdog,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=_response_headers(upstream, route))
        await response.prepare(request)
        outcome.streamed = True
        first_at = 0.0
        events = 0
        previous = last = b""
        content = upstream.content
        try:
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                watchdog.last = time.monotonic()
                if not first_at:
                    first_at = watchdog.last
                events += chunk.count(b"data: ")
                previous, last = last, chunk
                await response.write(chunk)
        except asyncio.CancelledError:
            if not watchdog.absorb():
                raise
            replica.failed(f"stream silent for {self.settings.timeouts.idle_s:g} s")
            outcome.status = 504
            await response.write(_MID_STREAM_ERROR)
        except aiohttp.ClientError as exc:
            replica.failed(f"stream broke: {exc!r}")
            outcome.status = 502
            await response.write(_MID_STREAM_ERROR)
        await response.write_eof()
        if first_at:
            outcome.ttft_s = first_at - started
            outcome.completion_tokens = completion_tokens(previous + last)
            tokens = outcome.completion_tokens or max(events - 2, 0)
            if tokens > 1:
                outcome.tpot_s = (watchdog.last - first_at) / (tokens - 1)
        return response

    def _account(
        self, replica: Replica, decision: Decision, features: RequestFeatures, headers: RoutingHeaders, outcome: Outcome
    ) -> None:
        pool = replica.pool.value
        self.metrics.requests.labels(pool, decision.reason, str(outcome.status)).inc()
        if outcome.status >= 400:
            return
        if outcome.completion_tokens is not None:
            self.lengths.observe(
                features.model, features.prompt_tokens, outcome.completion_tokens, headers.request_class
            )
        if outcome.streamed:
            replica.observe(outcome.ttft_s, outcome.tpot_s, *decision.predicted_s)
            if outcome.ttft_s is not None:
                self.metrics.ttft.labels(pool).observe(outcome.ttft_s)
                if decision.predicted_ttft_ms is not None:
                    error = decision.predicted_ttft_ms / 1e3 - outcome.ttft_s
                    self.metrics.ttft_error.labels(pool).observe(error)
            if outcome.tpot_s is not None:
                self.metrics.tpot.labels(pool).observe(outcome.tpot_s)
        if headers.slo_ttft_ms is not None and outcome.ttft_s is not None:
            met = outcome.ttft_s * 1e3 <= headers.slo_ttft_ms
            self.metrics.slo.labels("ttft", "met" if met else "missed").inc()
        if headers.slo_tpot_ms is not None and outcome.tpot_s is not None:
            met = outcome.tpot_s * 1e3 <= headers.slo_tpot_ms
            self.metrics.slo.labels("tpot", "met" if met else "missed").inc()


class _Watchdog:
    """Cancels an attempt whose upstream stays silent: first `first_byte_s` until the response
    starts, then `idle_s` between two chunks.

    One timer per attempt, re-armed only when it fires, instead of a timeout armed around every
    read: the relay loop just records when the last chunk came.
    """

    def __init__(self, first_byte_s: float, idle_s: float) -> None:
        self.idle_s = idle_s
        self.last = time.monotonic()
        self._fired = False
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(first_byte_s, self._fire)

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
            self._fire()

    def _fire(self) -> None:
        if self._task is not None:
            self._fired = True
            self._task.cancel()

    def absorb(self) -> bool:
        """After a CancelledError: True when the watchdog caused it (the task then goes on)."""
        if not self._fired or self._task is None:
            return False
        self._fired = False
        self._task.uncancel()
        return True

    def stop(self) -> None:
        self._timer.cancel()


def _response_headers(upstream: aiohttp.ClientResponse, route: dict[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.headers.items():
        lower = name.lower()
        if lower in _HOP_BY_HOP or lower in route or lower in ("date", "server"):
            continue
        out.add(name, value)
    out.update(route)
    return out
