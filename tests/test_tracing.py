"""Opt-in OpenTelemetry spans of the routing decisions, posted to a collector as OTLP/HTTP JSON."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from specgate.bench import upstream
from specgate.calibration.modes import Pool
from specgate.gateway.app import make_app
from specgate.gateway.config import ConfigError, GatewaySettings, parse_settings
from specgate.gateway.tracing import Span, Tracer, TracingSettings
from specgate.testing import running_app
from specgate.workers.pools import FleetSettings

MODEL = "bench"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Collector:
    """An OTLP/HTTP receiver: the spans posted to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.refuse = False

    async def traces(self, request: web.Request) -> web.Response:
        if self.refuse:
            return web.Response(status=503)
        body = orjson.loads(await request.read())
        for resource in body["resourceSpans"]:
            assert resource["resource"]["attributes"][0] == {
                "key": "service.name",
                "value": {"stringValue": "specgate"},
            }
            for scope in resource["scopeSpans"]:
                self.spans.extend(scope["spans"])
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self.traces)
        return app


def attributes(span: dict[str, Any]) -> dict[str, object]:
    return {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}


def traced(replica: str, otlp: str) -> GatewaySettings:
    """A gateway in front of `replica`, posting every request's span to the collector at `otlp`."""
    return GatewaySettings(
        models=(MODEL,), pools={Pool.PLAIN: (replica,)}, port=0, fleet=FleetSettings(scrape_interval_s=0.05),
        tracing=TracingSettings(otlp_url=f"{otlp}/v1/traces", interval_s=0.05),
    )  # fmt: skip


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, list[str | None]]]:
    """A fast fixed upstream that records the traceparent of each request it gets."""
    seen: list[str | None] = []

    @web.middleware
    async def record(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
        if request.method == "POST":
            seen.append(request.headers.get("traceparent"))
        return await handler(request)

    app = upstream.make_app()
    app.middlewares.append(record)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app.router.add_get("/health", health)
    async with running_app(app) as url:
        yield url, seen


async def test_each_request_is_a_span_under_the_clients_trace_and_the_replica_hangs_under_it(
    replica: tuple[str, list[str | None]],
) -> None:
    url, seen = replica
    collector = Collector()
    async with running_app(collector.app()) as otlp:
        settings = traced(url, otlp)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with running_app(make_app(settings)) as gateway, aiohttp.ClientSession() as session:
            parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            headers = {"traceparent": parent, "x-request-class": "chat", "x-slo-ttft-ms": "1000"}
            async with session.post(f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200
            async with session.post(f"{gateway}/v1/chat/completions", json=body) as r:  # a trace of its own
                assert r.status == 200
            unsampled = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}
            async with session.post(f"{gateway}/v1/chat/completions", json=body, headers=unsampled) as r:
                assert r.status == 200
            for _ in range(100):
                if len(collector.spans) >= 2:
                    break
                await asyncio.sleep(0.05)
    joined, own = collector.spans
    assert (joined["traceId"], joined["parentSpanId"]) == (CLIENT_TRACE, CLIENT_SPAN)
    assert seen[0] == f"00-{CLIENT_TRACE}-{joined['spanId']}-01"  # vLLM's spans under the gateway's
    assert "parentSpanId" not in own
    assert seen[1] == f"00-{own['traceId']}-{own['spanId']}-01"
    assert seen[2] == unsampled["traceparent"]  # not sampled: passed on as the client sent it
    got = attributes(joined)
    assert got["specgate.pool"] == "plain"
    assert got["specgate.replica"] == "plain-0"
    assert got["specgate.request_class"] == "chat"
    assert got["http.response.status_code"] == "200"
    assert got["specgate.slo_ttft_ms"] == 1000.0
    assert "specgate.reason" in got
    assert joined["status"] == {"code": 1}
    assert int(joined["endTimeUnixNano"]) >= int(joined["startTimeUnixNano"])


async def test_a_request_refused_before_it_is_parsed_is_traced_too(replica: tuple[str, list[str | None]]) -> None:
    url, seen = replica
    collector = Collector()
    async with running_app(collector.app()) as otlp:
        settings = traced(url, otlp)
        parent = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "content-type": "application/json"}
        async with running_app(make_app(settings)) as gateway, aiohttp.ClientSession() as session:
            async with session.post(f"{gateway}/v1/chat/completions", data=b"{not json", headers=parent) as r:
                assert r.status == 400
            for _ in range(100):
                if collector.spans:
                    break
                await asyncio.sleep(0.05)
    assert not seen  # nothing reached the replica
    (span,) = collector.spans
    assert (span["traceId"], span["parentSpanId"]) == (CLIENT_TRACE, CLIENT_SPAN)
    got = attributes(span)
    assert got["http.response.status_code"] == "400"
    assert got["url.path"] == "/v1/chat/completions"
    assert got["specgate.reason"] == "invalid_body"
    assert span["status"]["code"] == 2  # an error, with the gateway's message


async def test_a_collector_that_refuses_costs_dropped_spans_not_requests() -> None:
    collector = Collector()
    collector.refuse = True
    async with running_app(collector.app()) as otlp, aiohttp.ClientSession() as session:
        tracer = Tracer(TracingSettings(otlp_url=f"{otlp}/v1/traces", max_queued=3), session, seed=1)
        for _ in range(5):
            span = tracer.start(None)
            assert isinstance(span, Span)
            tracer.end(span, "specgate.route", {"k": 1})
        assert tracer.dropped == 2  # past the queue's bound
        await tracer.flush()
        assert (tracer.sent, tracer.dropped) == (0, 5)
        collector.refuse = False
        span = tracer.start(None)
        assert span is not None
        tracer.end(span, "specgate.route", {"http.response.status_code": 502}, error="upstream_failed")
        await tracer.flush()
        assert tracer.sent == 1
        (posted,) = collector.spans
        assert posted["status"] == {"code": 2, "message": "upstream_failed"}
        assert attributes(posted) == {"http.response.status_code": "502"}


def test_sampling_follows_the_ratio_and_ignores_malformed_parents() -> None:
    settings = TracingSettings(otlp_url="http://127.0.0.1:1/v1/traces", sample_ratio=0.25)
    tracer = Tracer(settings, None, seed=7)  # type: ignore[arg-type]  # sends nothing here
    sampled = sum(tracer.start(None) is not None for _ in range(4000))
    assert 850 < sampled < 1150
    for bad in ("garbage", f"00-{'0' * 32}-{CLIENT_SPAN}-01", f"01-{CLIENT_TRACE}-{CLIENT_SPAN}", "00-xyz-abc-01"):
        span = tracer.start(bad)  # treated as absent: a trace of the gateway's own, when sampled
        assert span is None or (span.parent_id is None and span.trace_id != CLIENT_TRACE)


def test_the_config_takes_a_collector_url_and_a_ratio() -> None:
    base = {"models": {"served": [MODEL]}, "pools": {"plain": {"urls": ["http://10.0.0.1:8000"]}}}
    settings = parse_settings({**base, "tracing": {"otlp_url": "http://otel:4318/v1/traces", "sample_ratio": 0.1}})
    assert settings.tracing == TracingSettings(otlp_url="http://otel:4318/v1/traces", sample_ratio=0.1)
    assert parse_settings(base).tracing.otlp_url is None
    for bad, key in (({"otlp_url": "otel:4318"}, "tracing.otlp_url"), ({"sample_ratio": 2}, "tracing.sample_ratio")):
        with pytest.raises(ConfigError) as caught:
            parse_settings({**base, "tracing": bad})
        assert caught.value.field.startswith(key)
