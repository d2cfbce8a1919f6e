"""Forwarding one request: choose a replica, send the bytes, relay the answer as it comes.

The relay reads what a decision needs into a `Journey`, asks the plan in force for a replica and
runs an `Attempt` there. An attempt that fails before any byte reached the client (a connect
failure, a 5xx, a 429) raises `RetryElsewhere`; the relay then decides again without the replicas
already tried, so the other pool serves when the first one's pool is down, up to the configured
number of replicas and within the retry budget. An attempt whose replica fails after the client's
stream began raises `StreamBroke`; the relay then continues the stream on another replica, within
the same bounds, or ends it with an error event. Whatever the end, `Feedback` learns from it in
one place.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from specgate.gateway.admission import AdmissionControl
from specgate.gateway.advisor import TrafficWindow
from specgate.gateway.attempt import Attempt, RetryElsewhere, StreamBroke
from specgate.gateway.body import parse_body
from specgate.gateway.clients import Clients, check_rights
from specgate.gateway.config import GatewaySettings
from specgate.gateway.connections import Connections
from specgate.gateway.continuation import SHUTDOWN, SHUTDOWN_ERROR, ClientStream, Continuation, resumable, shutting_down
from specgate.gateway.errors import (
    BadBody,
    BodyTimeout,
    BodyTooLarge,
    ContextTooLong,
    GatewayError,
    NoHealthyReplica,
    Overloaded,
    ShuttingDown,
    SloInfeasible,
    UnsupportedMediaType,
)
from specgate.gateway.feedback import Feedback
from specgate.gateway.journey import Journey, handler_task, upstream_headers
from specgate.gateway.metrics import GatewayMetrics
from specgate.gateway.sla import parse_routing_headers
from specgate.gateway.tracing import TRACEPARENT, Span, Tracer
from specgate.policies.admission import DEADLINE, QUEUE_FULL
from specgate.policies.decision import Hold, Shed
from specgate.policies.drafts import DraftStats, group
from specgate.policies.features import RequestFeatures
from specgate.policies.length import LengthStats
from specgate.policies.registry import RoutingPlan
from specgate.protocol.endpoints import Endpoint
from specgate.workers.pools import Fleet
from specgate.workers.snapshot import Snapshot

CROSS_SITE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
"""Bodies a web page on another site may send without the browser asking first: refused, so that
a page a user visits cannot spend the gateway's capacity in their name."""


class PlanSource(Protocol):
    """Whoever keeps the plan in force (the policy control); a new one is swapped in with one
    assignment, so each request reads it once and is routed by that plan throughout."""

    plan: RoutingPlan


class Relay:
    def __init__(
        self,
        settings: GatewaySettings,
        fleet: Fleet,
        connections: Connections,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        plans: PlanSource,
        admission: AdmissionControl,
        clients: Clients | None = None,
        window: TrafficWindow | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.connections = connections
        self.session = session
        self.metrics = metrics
        self.plans = plans
        self.admission = admission
        self.clients = clients
        """Client keys, when they are required."""
        self.lengths = LengthStats()
        self.drafts = DraftStats()
        self.tracer = tracer
        self.feedback = Feedback(
            metrics, self.lengths, self.drafts, access_log=settings.access_log, window=window, tracer=tracer
        )
        self._sequence = itertools.count(1)  # 0 would make the very first request an exploration
        self.routing = 0
        """Requests being routed or relayed now."""
        self.retrying = 0
        """Of those, requests on a retry."""
        self._handlers: set[asyncio.Task[object]] = set()

    async def drain(self, grace_s: float, farewell_s: float = 2.0) -> None:
        """Let the requests in flight finish for up to `grace_s`; then cut the rest, each told why
        (a 503, or an error event ending its stream), taking up to `farewell_s` more."""
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=grace_s)
        for task in self._handlers:
            task.cancel(SHUTDOWN)
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=farewell_s)

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        task = handler_task(request)
        self._handlers.add(task)
        try:
            return await self._handle(request, endpoint)
        finally:
            self._handlers.discard(task)

    async def _handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        # The span starts as the request arrives: one refused before its body was read or parsed
        # (too large, too slow, not JSON, a client without the rights) is traced too.
        span = self.tracer.start(request.headers.get(TRACEPARENT)) if self.tracer is not None else None
        try:
            key = self.clients.identify(request.headers) if self.clients is not None else None
            journey = await self._journey(request, endpoint, span)
            if key is not None:
                check_rights(key, journey.headers.forced_pool, journey.headers.priority)
        except GatewayError as error:
            self.feedback.refused(None, error, request, span)
            raise
        try:
            if key is not None and self.clients is not None:
                self.clients.admit(key)
        except GatewayError as error:
            self.feedback.refused(journey, error)
            raise
        fields = journey.fields
        journey.length = self.lengths.begin(fields.model, fields.prompt_tokens, journey.request_class)
        self.routing += 1
        try:
            return await self._route(journey)
        except GatewayError as error:
            self.feedback.refused(journey, error)
            raise
        finally:
            self.routing -= 1
            self.lengths.end(journey.length, None, time.monotonic())  # unless answered with its length
            if key is not None and self.clients is not None:
                self.clients.release(key)

    async def _journey(self, request: web.Request, endpoint: Endpoint, span: Span | None) -> Journey:
        if request.content_type in CROSS_SITE_TYPES:
            raise UnsupportedMediaType(f"send the body as application/json, not {request.content_type}")
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes")  # at once: not after reading it
        # A body already whole (the common case: it came with the headers) arms no timer.
        try:
            if request.content.is_eof():
                raw = await request.read()
            else:
                async with asyncio.timeout(self.settings.limits.body_timeout_s):
                    raw = await request.read()
        except TimeoutError:
            raise BodyTimeout(
                f"the request body did not arrive within {self.settings.limits.body_timeout_s:g} s"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"request body exceeds {limit} bytes") from None
        except RequestPayloadError as exc:  # a Content-Encoding the bytes do not match, a broken chunk
            raise BadBody(f"the request body could not be read: {exc}") from None
        fields = parse_body(raw, endpoint, self.settings.models)
        plan = self.plans.plan
        headers = parse_routing_headers(request.headers, plan.slo_for)
        draft_group = group(fields.model, endpoint.value, headers.request_class, fields.repetition)
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
            output_hinted=headers.expected_output_tokens is not None,
            draft_speedup=self.drafts.speedup(draft_group),
        )
        forwarded = upstream_headers(
            request, headers.request_id, forward_authorization=self.settings.forward_authorization
        )
        if span is not None:  # the replica's spans under the gateway's
            forwarded[TRACEPARENT] = span.traceparent
        return Journey(request, endpoint, raw, fields, headers, features, plan, forwarded, draft_group, span=span)

    async def _route(self, journey: Journey) -> web.StreamResponse:
        route = _Route()
        try:
            return await self._attempts(journey, route)
        except asyncio.CancelledError as cancel:
            if not shutting_down(cancel):
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # cut by the shutdown, the request is answered rather than dropped
            stream = route.stream
            if stream is None:
                raise ShuttingDown("the gateway is shutting down; send the request again") from None
            await stream.fail(SHUTDOWN_ERROR)
            return stream.response

    async def _attempts(self, journey: Journey, route: _Route) -> web.StreamResponse:
        retries = self.settings.retries
        failure: GatewayError | None = None
        withdrawn = False
        for number in range(retries.max_attempts):
            # A failover, or a request withdrawn from or failed by a replica out of rotation by now
            # (ejected, or resting after a 429), is not held to the retry budget: its replica no
            # longer serves it, so it moves load rather than adding to it; max_attempts bounds it.
            budgeted = bool(number) and route.continuation is None and not withdrawn
            if budgeted and not self._may_retry():
                break
            # Counted in progress from now, its backoff included: requests failing together must
            # not all pass the budget before any of them is counted.
            self.retrying += bool(number)
            try:
                response = await self._attempt(journey, route, number, budgeted)
            except RetryElsewhere as retry:
                failure, withdrawn = retry.error, retry.withdrawn
                continue
            except StreamBroke:
                if route.continuation is None:
                    break
                continue
            finally:
                self.retrying -= bool(number)
            if response is None:
                break
            return response
        stream = route.stream
        if route.broken_by is None or stream is None:
            raise failure or NoHealthyReplica("no healthy replica can take the request")
        if journey.headers.failover:
            self.metrics.failovers.labels("failed" if stream.failovers else "not_resumable").inc()
        await stream.fail()  # its headers went out long ago: the stream ends with an error event
        self.feedback.answered(journey, route.broken_by)
        return stream.response

    async def _attempt(self, journey: Journey, route: _Route, number: int, budgeted: bool) -> web.StreamResponse | None:
        """The request's `number`-th try: a replica chosen without those tried, and its answer;
        None when there is none to try (the relay ends the request). Raises RetryElsewhere when
        another replica may still serve it, StreamBroke when its stream broke (with the route
        told how it may go on)."""
        plan, retries = journey.plan, self.settings.retries
        if budgeted:
            await asyncio.sleep(retries.backoff_s * 2 ** (number - 1))
        snapshot = self._fitting(journey, self.fleet.snapshot(time.monotonic(), plan.profile))
        if journey.tried:
            snapshot = snapshot.without(frozenset(journey.tried))
        verdict = plan.decide(journey.features, snapshot)
        if isinstance(verdict, Hold):
            verdict = await self.admission.hold(journey)
        if verdict is None:
            return None
        if isinstance(verdict, Shed):
            self.metrics.decisions.labels(plan.policy.name, "none", verdict.reason).inc()
            if route.broken_by is not None:
                return None
            self.feedback.shed(journey)
            raise _refusal(verdict)
        decision = verdict
        replica = self.fleet.replicas.get(decision.replica.name)
        if replica is None:  # it left the fleet (discovery no longer finds it) while the request waited
            raise RetryElsewhere(NoHealthyReplica("the replica chosen left the fleet"), withdrawn=True)
        journey.tried.append(replica.name)
        self.metrics.decisions.labels(plan.policy.name, replica.pool.value, decision.reason).inc()
        if number:
            self.metrics.retries.labels(replica.pool.value).inc()
        last = number == retries.max_attempts - 1
        resuming = route.resuming()
        attempt = Attempt(
            journey,
            replica,
            decision,
            self.connections,
            self.session,
            self.settings.timeouts,
            self.lengths,
            last=last,
            resuming=resuming,
        )
        try:
            response = await attempt.run()
        except RetryElsewhere as retry:
            # A replica ejected by now (by this failure or another), or resting after its 429, takes
            # no requests: retrying elsewhere moves load off it, it does not add any.
            raise RetryElsewhere(retry.error, withdrawn=retry.withdrawn or not replica.available()) from None
        except StreamBroke as broke:
            route.stream, route.broken_by = broke.stream, attempt
            route.continuation = self._continuation(journey, broke) if broke.resumable else None
            raise
        except asyncio.CancelledError:
            route.stream = attempt.stream or route.stream
            self.feedback.answered(journey, attempt)  # the client left, or the gateway is shutting down
            raise
        finally:
            self.admission.kick()  # the replica has room again
        self.feedback.answered(journey, attempt)
        if resuming is not None:
            self.metrics.failovers.labels("resumed").inc()
        return response

    @staticmethod
    def _continuation(journey: Journey, broke: StreamBroke) -> Continuation | None:
        """How the broken stream goes on elsewhere; None when it must end here."""
        if not journey.headers.failover:
            return None
        continuation = resumable(journey.raw, journey.endpoint, broke.stream.sent)
        if continuation is not None:
            broke.stream.failovers += 1
        return continuation

    def _may_retry(self) -> bool:
        """Within the retry budget: a share of the requests in flight, so that a fleet failing
        whole is not hit by a storm of retries."""
        retries = self.settings.retries
        return self.retrying < max(retries.min_retries, retries.budget * self.routing)

    @staticmethod
    def _fitting(journey: Journey, snapshot: Snapshot) -> Snapshot:
        """The replicas whose context window holds the prompt; ContextTooLong when no healthy one does."""
        prompt = journey.features.prompt_tokens
        fitting = snapshot.fitting(prompt)
        if snapshot.healthy() and not fitting.healthy():
            window = max(r.max_model_len or 0 for r in snapshot.healthy())
            raise ContextTooLong(
                f"This model's maximum context length is {window} tokens; the prompt is about {prompt} tokens "
                "(estimated at four bytes a token). Shorten the prompt.",
                param="messages" if journey.endpoint is Endpoint.CHAT else "prompt",
            )
        return fitting


@dataclass
class _Route:
    """Where one request's attempts stand once the client's stream began."""

    stream: ClientStream | None = None
    broken_by: Attempt | None = None
    """The last attempt whose replica failed midway through the stream."""
    continuation: Continuation | None = None
    """How the stream goes on elsewhere; None when it cannot."""

    def resuming(self) -> tuple[ClientStream, Continuation] | None:
        if self.stream is None or self.continuation is None:
            return None
        return self.stream, self.continuation


def _refusal(shed: Shed) -> GatewayError:
    if shed.retry_after_s is None:
        return SloInfeasible(shed.detail or "no replica could meet this request's SLOs", reason=shed.reason)
    why = {
        DEADLINE: "no replica could serve it before its wait in the admission queue ran out",
        QUEUE_FULL: "the admission queue is full",
    }.get(shed.reason, "no replica can meet this request's SLO now")
    return Overloaded(f"{why}; retry later", retry_after_s=shed.retry_after_s, reason=shed.reason)
