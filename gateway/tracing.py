"""Opt-in OpenTelemetry traces of each request's routing decision, sent as OTLP/HTTP JSON.

With `[tracing] otlp_url` set, a sampled request gets a span (`specgate.route`): its model, the
policy, the pool and replica chosen, why, the predicted TTFT and TPOT, the attempts, the status,
the measured TTFT and the tokens generated. It joins the client's trace when the request carries a
W3C `traceparent` (and follows its sampled flag), else starts one (sampled at `sample_ratio`),
and the replica gets a `traceparent` naming the gateway's span, so vLLM's own spans
(`--otlp-traces-endpoint`) hang under it. Spans are batched and posted on the event loop, never on
the request's path: a collector that is slow or down costs dropped spans (counted), not latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections import deque
from dataclasses import dataclass, field

import aiohttp
import orjson

_log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
_PARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_NO_TRACE, _NO_SPAN = "0" * 32, "0" * 16


@dataclass(frozen=True)
class TracingSettings:
    otlp_url: str | None = None
    """Where spans are posted (an OTLP/HTTP collector's /v1/traces); None: no tracing."""
    sample_ratio: float = 1.0
    """Of the requests that do not say (no traceparent), the share traced."""
    service_name: str = "specgate"
    max_queued: int = 4096
    """Spans waiting to be sent; past it, new ones are dropped."""
    batch: int = 512
    interval_s: float = 1.0


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    start_ns: int = field(default_factory=time.time_ns)

    @property
    def traceparent(self) -> str:
        """What the replica is sent: this span as its parent, sampled."""
        return f"00-{self.trace_id}-{self.span_id}-01"


def _value(v: object) -> dict[str, object]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


class Tracer:
    def __init__(self, settings: TracingSettings, session: aiohttp.ClientSession, seed: int | None = None) -> None:
        self.settings = settings
        self.session = session
        self._rng = random.Random(seed)
        self._queued: deque[dict[str, object]] = deque()
        self._wake = asyncio.Event()
        self.sent = 0
        self.dropped = 0

    def _id(self, hex_digits: int) -> str:
        while True:
            value = f"{self._rng.getrandbits(hex_digits * 4):0{hex_digits}x}"
            if value.strip("0"):
                return value

    def start(self, traceparent: str | None) -> Span | None:
        """A span for a request, or None when it is not sampled."""
        match = _PARENT.match(traceparent.strip().lower()) if traceparent else None
        if match and match[1] != _NO_TRACE and match[2] != _NO_SPAN:
            if not int(match[3], 16) & 1:
                return None  # the client's trace is not sampled
            return Span(match[1], self._id(16), match[2])
        if self._rng.random() >= self.settings.sample_ratio:
            return None
        return Span(self._id(32), self._id(16), None)

    def end(self, span: Span, name: str, attributes: dict[str, object], *, error: str | None = None) -> None:
        """The request is over: its span joins the next batch (or is dropped when too many wait)."""
        if len(self._queued) >= self.settings.max_queued:
            self.dropped += 1
            return
        record: dict[str, object] = {
            "traceId": span.trace_id,
            "spanId": span.span_id,
            "name": name,
            "kind": 2,  # SERVER
            "startTimeUnixNano": str(span.start_ns),
            "endTimeUnixNano": str(time.time_ns()),
            "attributes": [{"key": k, "value": _value(v)} for k, v in attributes.items() if v is not None],
            "status": {"code": 2, "message": error} if error else {"code": 1},
        }
        if span.parent_id is not None:
            record["parentSpanId"] = span.parent_id
        self._queued.append(record)
        if len(self._queued) >= self.settings.batch:
            self._wake.set()

    def _body(self, spans: list[dict[str, object]]) -> bytes:
        resource = {"attributes": [{"key": "service.name", "value": {"stringValue": self.settings.service_name}}]}
        scope = {"scope": {"name": "specgate"}, "spans": spans}
        return orjson.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]})

    async def flush(self) -> None:
        """Posts what waits, a batch at a time; a batch the collector does not take is dropped."""
        assert self.settings.otlp_url is not None
        while self._queued:
            spans = [self._queued.popleft() for _ in range(min(len(self._queued), self.settings.batch))]
            try:
                async with self.session.post(
                    self.settings.otlp_url, data=self._body(spans), headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=5.0),
                ) as r:  # fmt: skip
                    if r.status >= 300:
                        raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
                self.sent += len(spans)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not self.dropped:
                    _log.warning("tracing: the collector did not take %d spans: %r", len(spans), exc)
                self.dropped += len(spans)
                return

    async def run(self) -> None:
        """Sends the spans every `interval_s`, or sooner when a batch is full; the last on the way out."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.settings.interval_s)
                self._wake.clear()
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.flush())
