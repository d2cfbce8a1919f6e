"""The gateway over real HTTP, in front of simulated replicas running as subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import json
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from specgate.calibration.modes import Pool
from specgate.gateway.advisor import AdvisorSettings, split_gain
from specgate.gateway.app import make_app, make_runner
from specgate.gateway.clients import ClientKey, hashed
from specgate.gateway.config import AuthSettings, GatewaySettings, Retries, StoreSettings, Timeouts
from specgate.gateway.exchange import CountExchange, ExchangeSettings
from specgate.gateway.server import Limits
from specgate.gateway.state import RELAY
from specgate.policies.decision import Shedding
from specgate.policies.document import PolicyDocument
from specgate.testing import RedisServer, SimProcess, equals, running_app, sample_value, until
from specgate.workers import launch
from specgate.workers.pools import FleetSettings
from specgate.workers.shared import SharedCounts

SimFactory = Callable[..., SimProcess]
MODEL = "sim-model"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Route me well."}]
ROUTE_HEADERS = ("x-route-pool", "x-route-replica", "x-route-reason", "x-policy-version", "x-request-id")
PREDICTION_HEADERS = ("x-predicted-ttft-ms", "x-predicted-tpot-ms")


def sim(factory: SimFactory, mode: str, *extra: str) -> SimProcess:
    return factory("--mode", mode, "--model", MODEL, "--time-scale", "20", *extra)


@pytest.fixture(scope="module")
def fleet(sim_factory: SimFactory) -> dict[Pool, list[SimProcess]]:
    return {Pool.SPECULATIVE: [sim(sim_factory, "speculative")], Pool.PLAIN: [sim(sim_factory, "plain")]}


def settings_for(pools: dict[Pool, list[str]], **changes: Any) -> GatewaySettings:
    base = GatewaySettings(
        models=(MODEL,),
        pools={pool: tuple(urls) for pool, urls in pools.items()},
        port=0,
        fleet=FleetSettings(scrape_interval_s=0.05),
    )
    return dataclasses.replace(base, **changes)


def running_gateway(settings: GatewaySettings) -> contextlib.AbstractAsyncContextManager[str]:
    app = make_app(settings)
    return running_app(app, make_runner(app, dataclasses.replace(settings, shutdown_grace_s=1.0)))


def urls(fleet: dict[Pool, list[SimProcess]]) -> dict[Pool, list[str]]:
    return {pool: [s.url for s in sims] for pool, sims in fleet.items()}


@pytest.fixture
async def gateway(fleet: dict[Pool, list[SimProcess]]) -> AsyncIterator[str]:
    async with running_gateway(settings_for(urls(fleet))) as url:
        yield url


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="client-key", max_retries=0, timeout=30)


def assert_route_headers(headers: Any) -> None:
    for name in (*ROUTE_HEADERS, *PREDICTION_HEADERS):
        assert headers.get(name), name
    assert headers["x-route-pool"] in ("speculative", "plain")
    assert float(headers["x-predicted-ttft-ms"]) > 0


async def test_chat_non_streaming(gateway: str) -> None:
    async with client(gateway) as api:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": "req-42"},
        )  # fmt: skip
    assert_route_headers(raw.headers)
    assert raw.headers["x-request-id"] == "req-42"
    reply = raw.parse()
    assert reply.id == "chatcmpl-req-42"  # the replica saw the same request id
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 20


async def test_chat_streaming(gateway: str) -> None:
    async with (
        client(gateway) as api,
        api.chat.completions.with_streaming_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=30, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        ) as response,
    ):  # fmt: skip
        assert_route_headers(response.headers)
        chunks = [chunk async for chunk in await response.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 30
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30


@pytest.mark.parametrize("stream", [False, True])
async def test_output_lengths_are_learned_in_the_order_their_answers_began(
    fleet: dict[Pool, list[SimProcess]], stream: bool
) -> None:
    settings = settings_for(urls(fleet))
    app = make_app(settings)
    async with running_app(app, make_runner(app, dataclasses.replace(settings, shutdown_grace_s=1.0))) as url:
        relay = app[RELAY]

        async def ask(max_tokens: int) -> int:
            async with client(url) as api:
                if not stream:
                    reply = await api.chat.completions.create(
                        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, extra_body={"ignore_eos": True}
                    )
                    assert reply.usage is not None
                    return reply.usage.completion_tokens
                chunks = await api.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )  # fmt: skip
                usage = [chunk.usage async for chunk in chunks if chunk.usage is not None]
                return usage[-1].completion_tokens

        long = asyncio.create_task(ask(1000))

        async def begun() -> bool:
            return bool(relay.lengths._queues)

        assert await until(begun, 10.0)  # the long one has begun (and runs for seconds)
        assert list(await asyncio.gather(ask(4), ask(4), ask(4))) == [4, 4, 4]
        assert not long.done()
        assert relay.lengths.groups.counts == {}  # the short answers wait for the long one's
        assert await long == 1000
    assert sum(relay.lengths.groups.counts.values()) == 4
    assert not relay.lengths._queues  # nothing held once every request has ended


@pytest.mark.parametrize("stream", [False, True])
async def test_completions(gateway: str, stream: bool) -> None:
    async with client(gateway) as api:
        if stream:
            async with api.completions.with_streaming_response.create(
                model=MODEL, prompt="Once upon a time", max_tokens=12, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            ) as response:  # fmt: skip
                assert_route_headers(response.headers)
                chunks = [c async for c in await response.parse()]
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 12
        else:
            raw = await api.completions.with_raw_response.create(
                model=MODEL, prompt=[1, 2, 3, 4], max_tokens=12, extra_body={"ignore_eos": True}
            )
            assert_route_headers(raw.headers)
            reply = raw.parse()
            assert reply.usage is not None
            assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 12)


@pytest.mark.parametrize("pool", list(Pool))
async def test_forced_pool_is_honoured(gateway: str, pool: Pool) -> None:
    async with client(gateway) as api:
        for _ in range(3):
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-route-pool": pool.value}
            )
            assert raw.headers["x-route-pool"] == pool.value
            assert raw.headers["x-route-reason"] == "forced"


async def test_policy_can_forbid_pool_override(fleet: dict[Pool, list[SimProcess]]) -> None:
    policy = PolicyDocument(policy="plain-only", allow_pool_override=False)
    async with running_gateway(settings_for(urls(fleet), policy=policy)) as url, client(url) as api:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-route-pool": "speculative"}
        )
    assert raw.headers["x-route-pool"] == "plain"
    assert raw.headers["x-route-reason"] == "plain-only"


async def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", data=body, headers=headers or {}) as response,
    ):
        return response.status, json.loads(await response.read())


GOOD = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).encode()


@pytest.mark.parametrize(
    ("body", "headers", "status", "param"),
    [
        (b"{nope", {}, 400, None),
        (b'{"model": "other", "messages": []}', {}, 404, "model"),
        (b'{"model": "sim-model", "messages": [], "stream": 1}', {}, 400, "stream"),
        (GOOD, {"x-slo-ttft-ms": "soon"}, 400, "x-slo-ttft-ms"),
        (GOOD, {"x-slo-tpot-ms": "-1"}, 400, "x-slo-tpot-ms"),
        (GOOD, {"x-expected-output-tokens": "lots"}, 400, "x-expected-output-tokens"),
        (GOOD, {"x-route-pool": "fastest"}, 400, "x-route-pool"),
        (GOOD, {"x-priority": "urgent"}, 400, "x-priority"),
        (GOOD, {"x-request-id": "a b"}, 400, "x-request-id"),
    ],
)
async def test_bad_requests_get_openai_errors(
    gateway: str, body: bytes, headers: dict[str, str], status: int, param: str | None
) -> None:
    code, payload = await post(gateway, body, headers)
    assert code == status
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["param"] == param


@contextlib.asynccontextmanager
async def busy_plain_replica(sim_factory: SimFactory, policy: PolicyDocument, **changes: Any) -> AsyncIterator[str]:
    """A gateway in front of one plain replica in real time, 40 streams on it for about 3 s: its
    batch too large for a 40 ms TPOT (the profile's step at batch 41 is about 43 ms) until they end."""
    replica = sim_factory("--mode", "plain", "--model", MODEL)
    long = {"model": MODEL, "messages": MESSAGES, "max_tokens": 70, "ignore_eos": True, "stream": True}
    settings = settings_for({Pool.PLAIN: [replica.url]}, policy=policy, **changes)
    async with running_gateway(settings) as url, aiohttp.ClientSession() as session:
        streams = [await session.post(f"{url}/v1/chat/completions", json=long) for _ in range(40)]
        try:
            for stream in streams:
                await stream.content.readline()
            yield url
        finally:
            for stream in streams:
                stream.close()


@pytest.mark.parametrize(("priority", "status"), [("-1", 429), ("0", 200)])
async def test_adaptive_sheds_low_priority_requests_it_cannot_serve_now(
    sim_factory: SimFactory, priority: str, status: int
) -> None:
    policy = PolicyDocument(shedding=Shedding(enabled=True, below_priority=0, retry_after_s=3))
    async with busy_plain_replica(sim_factory, policy) as url, aiohttp.ClientSession() as session:
        headers = {"x-slo-tpot-ms": "40", "x-priority": priority}
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == status
            answer = await r.json()
            if status == 429:
                assert r.headers["Retry-After"] == "3"
                assert answer["error"]["code"] == "slo_unattainable"
            else:  # held in the gateway until it could be served (or nearly: a fair chance), not refused
                assert r.headers["x-route-reason"] in ("meets-slo", "best-chance")


async def test_admission_queue_holds_then_serves_and_refuses_past_the_deadline(sim_factory: SimFactory) -> None:
    async with busy_plain_replica(sim_factory, PolicyDocument()) as url, aiohttp.ClientSession() as session:
        chat = f"{url}/v1/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
        sent = time.monotonic()
        held = asyncio.create_task(session.post(chat, json=body, headers={"x-slo-tpot-ms": "40"}))
        await asyncio.sleep(0.3)
        assert await gateway_sample(url, "specgate_queue_depth") == 1.0
        held_ms = (time.monotonic() - sent) * 1e3  # at least, when it is served
        # a 100 ms TTFT target while the batch is full: refused once three times that have passed
        started = time.monotonic()
        async with session.post(chat, json=body, headers={"x-slo-tpot-ms": "40", "x-slo-ttft-ms": "100"}) as r:
            assert r.status == 429
            assert (await r.json())["error"]["code"] == "deadline"
            assert "Retry-After" in r.headers
        assert 0.3 <= time.monotonic() - started < 1.0
        response = await held  # served once the streams end
        assert response.status == 200
        assert response.headers["x-route-reason"] in ("meets-slo", "best-chance")
        # the TTFT its client sees: the time it was held counts
        assert float(response.headers["x-predicted-ttft-ms"]) > held_ms
        await response.read()
        assert await gateway_sample(url, "specgate_queue_dropped_total", reason="deadline") == 1.0
        assert await gateway_sample(url, "specgate_queue_depth") == 0.0


async def test_a_gateway_tells_the_other_gateways_how_many_requests_it_holds_that_can_be_saved(
    sim_factory: SimFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Through the Redis they share: while it holds one, the others place none of theirs whose
    target has passed (`policies/admission.py`)."""
    store = StoreSettings(url=redis_server.url, prefix="held")
    other = SharedCounts(SharedCounts.create(1, tmp_path, others=True), 1, 0, others=True)
    exchange = CountExchange(redis_server.url, "held", other, (1.0, 1.0), ExchangeSettings())
    try:
        async with busy_plain_replica(sim_factory, PolicyDocument(), store=store) as url, aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5}
            headers = {"x-slo-tpot-ms": "40", "x-slo-ttft-ms": "10000"}
            held = asyncio.create_task(s.post(f"{url}/v1/chat/completions", json=body, headers=headers))

            async def seen() -> float:
                await exchange.once()
                return other.held_elsewhere()

            assert await until(lambda: equals(seen(), 1.0), timeout_s=5.0)
            assert await gateway_sample(url, "specgate_queue_held_elsewhere") == 0.0  # it is the only one
            response = await held
            assert response.status == 200
            await response.read()
            assert await until(lambda: equals(seen(), 0.0), timeout_s=5.0)
    finally:
        await exchange.close()
        other.close()


async def gateway_sample(url: str, name: str, **labels: str) -> float | None:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        return sample_value(await r.text(), name, **labels)


async def test_each_pool_s_throughput_and_the_cost_of_its_tokens(fleet: dict[Pool, list[SimProcess]]) -> None:
    prices = {Pool.SPECULATIVE: 3.49, Pool.PLAIN: 1.0}
    async with running_gateway(settings_for(urls(fleet), usd_per_replica_hour=prices)) as url, client(url) as api:
        assert await gateway_sample(url, "specgate_output_tokens_per_second", pool="plain") == 0.0
        assert await gateway_sample(url, "specgate_usd_per_million_output_tokens", pool="plain") == float("inf")
        for pool, tokens in (("speculative", 20), ("plain", 30)):
            await api.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=tokens, extra_body={"ignore_eos": True},
                extra_headers={"x-route-pool": pool},
            )  # fmt: skip
        stream = await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, stream=True, extra_body={"ignore_eos": True},
            extra_headers={"x-route-pool": "plain"},
        )  # fmt: skip
        async for _ in stream:  # no usage asked for: its tokens are counted from its events
            pass
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
            text = await r.text()
    assert sample_value(text, "specgate_output_tokens_total", pool="speculative") == 20
    assert sample_value(text, "specgate_output_tokens_total", pool="plain") == 40
    for pool, price in prices.items():
        rate = sample_value(text, "specgate_output_tokens_per_second", pool=pool.value)
        assert rate is not None
        assert rate > 0
        cost = sample_value(text, "specgate_usd_per_million_output_tokens", pool=pool.value)
        assert cost == pytest.approx(price / (rate * 3600) * 1e6, rel=0.05)  # one replica a pool


async def test_the_advisor_plans_the_split_on_the_recent_traffic(fleet: dict[Pool, list[SimProcess]]) -> None:
    token = "admin-token-0123456789"
    advisor = AdvisorSettings(interval_s=1.0, window_s=600.0, min_requests=7)
    settings = settings_for(urls(fleet), advisor=advisor, admin_token=token)
    slo = {"x-slo-ttft-ms": "3000", "x-slo-tpot-ms": "60"}
    async with running_gateway(settings) as url, client(url) as api, aiohttp.ClientSession() as session:
        assert math.isnan(await gateway_sample(url, "specgate_recommended_speculative_replicas") or 0.0)
        for _ in range(6):
            await api.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=30, extra_body={"ignore_eos": True}, extra_headers=slo
            )
        # One the policy refuses (no replica reaches its TTFT): traffic too, the seventh planned on;
        # one the gateway refuses for the client's sake (not JSON) is not.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 40_000}], "max_tokens": 5}
        async with session.post(f"{url}/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": "100"}) as r:
            assert r.status == 400
        async with session.post(
            f"{url}/v1/chat/completions", data=b"{", headers={"content-type": "application/json"}
        ) as r:
            assert r.status == 400
        recommended = None
        for _ in range(150):  # a plan a second, each a child process simulating three splits
            recommended = await gateway_sample(url, "specgate_recommended_speculative_replicas")
            if recommended is not None and not math.isnan(recommended):
                break
            await asyncio.sleep(0.1)
        assert recommended in (0.0, 1.0, 2.0)
        async with session.get(f"{url}/admin/fleet", headers={"authorization": f"Bearer {token}"}) as r:
            view = (await r.json())["advisor"]
    assert view["recommended_speculative_replicas"] == recommended
    assert view["current_speculative_replicas"] == 1
    assert view["requests"] == 7
    assert (view["slo_ttft_ms"], view["slo_tpot_ms"]) == (3000, 60)
    assert set(view["attainment_by_speculative_replicas"]) == {"0", "1", "2"}
    good = view["good_tokens_per_s_by_speculative_replicas"]
    assert set(good) == {"0", "1", "2"}
    assert max(good.values()) > 0  # some split serves some of them in time
    # (six requests within 0.2 s and a 10,000-token prompt on the A100 34B profile, three times
    # over: a split may meet none of them, and a gain over nothing is infinite, shown as null)
    gain = split_gain({int(k): v for k, v in good.items()}, int(recommended), 1)
    assert view["predicted_gain"] == (pytest.approx(gain) if math.isfinite(gain) else None)
    error = view["predicted_gain_error"]  # the gain's noise, from the plan's stretches of traffic
    assert error == 0.0 if recommended == 1.0 else 0.0 <= error < math.inf
    # Switching is off: no plan is counted toward a move.
    assert view["streak"] == {"direction": 0, "plans": 0, "pooled_gain": 0.0, "pooled_gain_error": 0.0,
                              "confirmed": False}  # fmt: skip


async def test_a_request_no_replica_could_serve_even_idle_is_refused_at_once(gateway: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 40_000}], "max_tokens": 5}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gateway}/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": "100"}) as r,
    ):
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["code"] == "slo_infeasible"
    assert "x-slo-ttft-ms 100 " in error["message"]


async def test_a_prompt_past_every_replicas_context_window_is_refused_before_a_replica(gateway: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 80_000}], "max_tokens": 5}
    async with aiohttp.ClientSession() as session, session.post(f"{gateway}/v1/chat/completions", json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert "16384" in error["message"]


async def test_replica_errors_pass_through_unchanged(gateway: str, fleet: dict[Pool, list[SimProcess]]) -> None:
    too_long = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6})
    direct = await post(fleet[Pool.PLAIN][0].url, too_long.encode())
    via_gateway = await post(gateway, too_long.encode(), {"x-route-pool": "plain"})
    assert via_gateway == direct
    assert direct[0] == 400


async def test_body_over_the_limit_is_413(fleet: dict[Pool, list[SimProcess]]) -> None:
    async with running_gateway(settings_for(urls(fleet), max_body_bytes=1024)) as url:
        code, payload = await post(url, b'{"messages": [], "pad": "' + b"x" * 4096 + b'"}')
    assert code == 413
    assert payload["error"]["code"] == "body_too_large"


async def test_no_healthy_replica_is_503() -> None:
    dead = {Pool.PLAIN: ["http://127.0.0.1:9"], Pool.SPECULATIVE: []}
    async with running_gateway(settings_for(dead)) as url:
        code, payload = await post(url, GOOD)
        async with aiohttp.ClientSession() as session, session.get(f"{url}/ready") as ready:
            assert ready.status == 503
    assert code == 503
    assert payload["error"]["code"] == "no_healthy_replica"


async def test_upstream_timeout_is_504(fleet: dict[Pool, list[SimProcess]]) -> None:
    timeouts = Timeouts(first_byte_s=0.05)
    slow = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "ignore_eos": True}).encode()
    async with running_gateway(settings_for(urls(fleet), timeouts=timeouts)) as url:
        code, payload = await post(url, slow)
    assert code == 504
    assert payload["error"]["code"] == "upstream_timeout"


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/chat/completions", 405), ("GET", "/nope", 404)])
async def test_unknown_routes_answer_in_the_openai_shape(gateway: str, method: str, path: str, status: int) -> None:
    async with aiohttp.ClientSession() as session, session.request(method, f"{gateway}{path}") as r:
        assert r.status == status
        body = await r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    reason = {404: "not_found", 405: "method_not_allowed"}[status]
    assert (await gateway_error_counts(gateway)).get((reason, str(status)), 0) >= 1  # counted as the others are


async def test_models_health_ready_metrics(gateway: str, fleet: dict[Pool, list[SimProcess]]) -> None:
    async with client(gateway) as api:
        await api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"x-slo-ttft-ms": "9999"}
        )
        models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gateway}/health") as r:
            assert r.status == 200
        async with session.get(f"{gateway}/ready") as r:
            assert r.status == 200
            body = await r.json()
            assert body["replicas"]["spec-0"]["healthy"] is True
        async with session.get(f"{gateway}/metrics") as r:
            text = await r.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    up = {labels: v for (name, labels), v in samples.items() if name == "specgate_replica_up"}
    assert set(up.values()) == {1.0}
    assert len(up) == 2
    assert sum(v for (name, _), v in samples.items() if name == "specgate_requests_total") >= 1
    assert sum(v for (name, _), v in samples.items() if name == "specgate_slo_total") >= 1


async def gateway_samples(url: str, name: str) -> dict[str, float]:
    """One gateway metric's values by replica label."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    return {
        s.labels.get("replica", ""): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


@pytest.mark.parametrize("stream", [True, False])
async def test_client_abort_drops_the_replicas_running_count(sim_factory: SimFactory, stream: bool) -> None:
    replica = sim(sim_factory, "plain")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    async with running_gateway(settings_for({Pool.PLAIN: [replica.url]})) as url:
        async with aiohttp.ClientSession() as session:
            pending = asyncio.create_task(session.post(f"{url}/v1/chat/completions", json=body))
            await asyncio.to_thread(replica.wait_for, "vllm:num_requests_running", lambda v: v == 1)
            if stream:
                response = await pending
                await response.content.readline()
                response.close()
            else:
                pending.cancel()
        await asyncio.to_thread(replica.wait_for, "vllm:num_requests_running", lambda v: v == 0)
        assert await gateway_samples(url, "specgate_replica_in_flight") == {"plain-0": 0.0}
    assert replica.sample("vllm:request_success_total", finished_reason="abort") == 1


async def test_killing_a_replica_fails_no_request_that_had_not_started_streaming(sim_factory: SimFactory) -> None:
    victim, survivor = sim(sim_factory, "plain"), sim(sim_factory, "plain")
    settings = settings_for({Pool.PLAIN: [victim.url, survivor.url]}, policy=PolicyDocument(policy="round-robin"))
    async with running_gateway(settings) as url, client(url) as api:

        async def one(i: int) -> str:
            await asyncio.sleep(0.01 * i)
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=60, extra_body={"ignore_eos": True}
            )
            reply = raw.parse()
            assert reply.usage is not None
            assert reply.usage.completion_tokens == 60
            return raw.headers["x-route-replica"]

        load = [asyncio.create_task(one(i)) for i in range(60)]
        await asyncio.to_thread(victim.wait_for, "vllm:num_requests_running", lambda v: v >= 3)
        victim.proc.send_signal(signal.SIGKILL)
        served_by = await asyncio.gather(*load)  # raises if any request failed
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
            metrics = await r.text()
        # nothing leaked: every dispatch was matched by its end, the dead replica's included
        assert await gateway_samples(url, "specgate_replica_in_flight") == {"plain-0": 0.0, "plain-1": 0.0}
    assert served_by.count("plain-1") > 30  # it took over
    # requests in flight on the victim when it died were retried on the survivor
    assert 'specgate_retries_total{pool="plain"}' in metrics
    retried = next(line for line in metrics.splitlines() if line.startswith('specgate_retries_total{pool="plain"}'))
    assert float(retried.split()[-1]) >= 3


async def healthy(_: web.Request) -> web.Response:
    """vLLM's /health: 200 while its engine is alive."""
    return web.Response()


def broken_replica() -> web.Application:
    """A replica whose engine has died: healthy metrics, 500 on every completion (as vLLM's EngineDeadError)."""

    async def fail(_: web.Request) -> web.Response:
        error = {
            "message": "EngineCore encountered an issue.",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
        return web.json_response({"error": error}, status=500)

    return scripted_replica(fail)


async def test_5xx_before_any_byte_is_retried_in_the_other_pool(fleet: dict[Pool, list[SimProcess]]) -> None:
    async with running_app(broken_replica()) as broken:
        pools = {Pool.SPECULATIVE: [broken], Pool.PLAIN: [fleet[Pool.PLAIN][0].url]}
        async with running_gateway(settings_for(pools)) as url, client(url) as api:
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-route-pool": "speculative"}
            )
            assert raw.headers["x-route-replica"] == "plain-0"
            assert raw.headers["x-route-reason"] == "speculative-pool-down"
            async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
                assert 'specgate_retries_total{pool="plain"} 1.0' in await r.text()


async def test_embedded_default_answers_straight_after_start(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    proc = launch.spawn([*launch.sim_argv()[:3], "serve", "--port", "0", "--time-scale", "20"], log)
    try:
        url = await launch.wait_ready(proc, log, wait_s=60)
        assert "try: curl" in log.read_text()
        async with client(url) as api:
            models = await api.models.list()
            raw = await api.chat.completions.with_raw_response.create(
                model=models.data[0].id, messages=MESSAGES, max_tokens=8
            )
        assert_route_headers(raw.headers)
        assert raw.parse().choices[0].message.content
    finally:
        await launch.terminate(proc)
    assert proc.returncode == 0


async def test_sigterm_lets_streams_in_flight_finish(fleet: dict[Pool, list[SimProcess]], tmp_path: Path) -> None:
    config = tmp_path / "specgate.toml"
    config.write_text(
        f'[models]\nserved = ["{MODEL}"]\n[pools.plain]\nurls = ["{fleet[Pool.PLAIN][0].url}"]\n'
        "[server]\nshutdown_grace_s = 20\n"
    )
    log = tmp_path / "gateway.log"
    proc = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), log)
    try:
        url = await launch.wait_ready(proc, log)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            response = await session.post(f"{url}/v1/chat/completions", json=body)
            first = await response.content.readline()
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            with pytest.raises(aiohttp.ClientConnectionError):  # no longer accepting
                async with aiohttp.ClientSession() as fresh:
                    await fresh.get(f"{url}/health")
            rest = await response.content.read()
        assert rest.rstrip().endswith(b"data: [DONE]")  # the stream in flight finished whole
        assert proc.wait(timeout=20) == 0
    finally:
        await launch.terminate(proc)


async def read_stream(url: str, body: dict[str, Any], during: Callable[[], None] | None = None) -> bytes:
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        first = await r.content.readline()
        if during is not None:
            during()
        return first + await r.content.read()


async def test_silent_upstream_ends_the_stream_with_an_error_event(sim_factory: SimFactory) -> None:
    replica = sim_factory("--mode", "plain", "--model", MODEL)  # real time: ~38 ms between tokens
    settings = settings_for({Pool.PLAIN: [replica.url]}, timeouts=Timeouts(idle_s=0.01))
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "ignore_eos": True, "stream": True}
    async with running_gateway(settings) as url:
        text = await read_stream(url, body)
    assert text.rstrip().endswith(b'"code": "upstream_failed"}}')
    assert b"[DONE]" not in text
    await asyncio.to_thread(replica.wait_for, "vllm:num_requests_running", lambda v: v == 0)


async def test_replica_dying_mid_stream_ends_the_stream_with_an_error_event(sim_factory: SimFactory) -> None:
    replica = sim(sim_factory, "plain")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with running_gateway(settings_for({Pool.PLAIN: [replica.url]})) as url:
        text = await read_stream(url, body, during=lambda: replica.proc.send_signal(signal.SIGKILL))
    assert text.startswith(b"data: {")
    assert text.rstrip().endswith(b'"code": "upstream_failed"}}')


def echo_replica() -> web.Application:
    """A replica that answers with the headers it received, to see what the gateway forwards."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"headers": {k.lower(): v for k, v in request.headers.items()}, "body": body.decode()})

    return scripted_replica(echo)


# Spacing, key order, escapes and unknown fields that a re-encoding router would change.
ODD_BUT_VALID = (
    b'{ "messages" :[{"role":"user","content":"caf\\u00e9 \xe2\x98\x95"}],\n "model":"sim-model",'
    b' "max_tokens": 2, "x_vendor_field": {"keep": [1.50, 2e3]} }'
)


@pytest.mark.parametrize("forward", [False, True])
async def test_forwarded_headers(forward: bool) -> None:
    async with running_app(echo_replica()) as replica:
        settings = settings_for({Pool.PLAIN: [replica]}, forward_authorization=forward)
        async with running_gateway(settings) as url:
            status, seen = await post(
                url,
                ODD_BUT_VALID,
                {
                    "Authorization": "Bearer client-secret",
                    "Proxy-Authorization": "Basic x",
                    "TE": "trailers",
                    "X-Custom": "kept",
                    "x-request-id": "abc",
                    "Content-Type": "application/json",
                },
            )
    assert status == 200
    headers = seen["headers"]
    assert headers["x-custom"] == "kept"
    assert headers["x-request-id"] == "abc"
    assert "proxy-authorization" not in headers
    assert "te" not in headers
    assert ("authorization" in headers) is forward
    assert seen["body"].encode() == ODD_BUT_VALID  # the body went out byte for byte


def scripted_replica(answer: Callable[[web.Request], Any]) -> web.Application:
    """A replica whose scrape always succeeds and whose completions `answer` scripts."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", healthy)
    app.router.add_post("/v1/chat/completions", answer)
    return app


async def test_a_replica_dying_mid_event_leaves_a_well_formed_error_event() -> None:
    async def half_an_event(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", ')
        await asyncio.sleep(0.05)
        await response.write(b'"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\ndata: {"id": "x", "obj')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # dies mid-event
        return response

    async with (
        running_app(scripted_replica(half_an_event)) as replica,
        running_gateway(settings_for({Pool.PLAIN: [replica]})) as url,
    ):
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True}
            ) as r,
        ):
            text = await r.content.read()
        events = [e for e in text.split(b"\n\n") if e]
        assert [json.loads(e.removeprefix(b"data: ")) for e in events][-1]["error"]["code"] == "upstream_failed"
        assert len(events) == 2  # the whole event, then the error: the unfinished one never went out
        stream = await client(url).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        with pytest.raises(openai.APIError, match="mid-stream"):  # a typed error, not a JSON one
            async for _ in stream:
                pass


async def test_clients_that_abort_streams_never_eject_a_healthy_replica(sim_factory: SimFactory) -> None:
    replica = sim(sim_factory, "plain")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "ignore_eos": True, "stream": True}
    settings = settings_for({Pool.PLAIN: [replica.url]}, fleet=FleetSettings(scrape_interval_s=0.05, eject_after=1))
    async with running_gateway(settings) as url:

        async def abort() -> None:
            async with aiohttp.ClientSession() as session:
                response = await session.post(f"{url}/v1/chat/completions", json=body)
                await response.content.readline()
                response.close()  # leaves mid-stream

        await asyncio.gather(*(abort() for _ in range(40)))
        assert await gateway_samples(url, "specgate_replica_up") == {"plain-0": 1.0}
        async with client(url) as api:  # a bystander is served
            reply = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert reply.choices[0].message.content
        statuses = await gateway_status_counts(url)
    assert statuses.get("499", 0) >= 1


async def gateway_error_counts(url: str) -> dict[tuple[str, str], float]:
    """The gateway's own errors in specgate_requests_total (pool `none`), by reason and status."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    return {
        (s.labels["reason"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specgate_requests_total" and s.labels["pool"] == "none"
    }


async def gateway_status_counts(url: str) -> dict[str, float]:
    """specgate_requests_total summed by status."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specgate_requests_total":
                counts[s.labels["status"]] = counts.get(s.labels["status"], 0.0) + s.value
    return counts


async def test_the_gateways_own_errors_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def fail(_: web.Request) -> web.Response:
        raise AssertionError("a refused request must not reach a replica")

    async with running_app(scripted_replica(fail)) as replica:
        settings = settings_for({Pool.PLAIN: [replica]}, access_log=True)
        async with running_gateway(settings) as url, aiohttp.ClientSession() as session:
            chat = f"{url}/v1/chat/completions"
            with caplog.at_level(logging.INFO, logger="specgate.access"):
                async with session.post(chat, json={"model": MODEL, "messages": MESSAGES},
                                        headers={"x-slo-ttft-ms": "soon", "x-request-id": "bad-1"}) as r:  # fmt: skip
                    assert r.status == 400
                async with session.post(chat, json={"model": "other", "messages": MESSAGES}) as r:
                    assert r.status == 404
                async with session.post(chat, data=b"{", headers={"x-request-id": "bad-2"}) as r:
                    assert r.status == 400
            statuses = await gateway_status_counts(url)
    assert statuses == {"400": 2.0, "404": 1.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "specgate.access"]
    # refused before a route began: counted, and a line each with what refused it
    assert lines == [
        "POST /v1/chat/completions 400 request_id=- reason=invalid_header",
        "POST /v1/chat/completions 404 request_id=- reason=model_not_found",
        "POST /v1/chat/completions 400 request_id=- reason=invalid_body",
    ]


async def test_the_access_log_has_a_line_per_routed_request(caplog: pytest.LogCaptureFixture) -> None:
    async def answer(_: web.Request) -> web.Response:
        return web.json_response({"choices": [], "usage": {"completion_tokens": 4}})

    async with running_app(scripted_replica(answer)) as replica:
        settings = settings_for({Pool.PLAIN: [replica]}, access_log=True)
        async with running_gateway(settings) as url, aiohttp.ClientSession() as session:
            with caplog.at_level(logging.INFO, logger="specgate.access"):
                body = {"model": MODEL, "messages": MESSAGES}
                headers = {"x-request-id": "req-7", "x-request-class": "chat"}
                async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200
    (line,) = [r.getMessage() for r in caplog.records if r.name == "specgate.access"]
    assert line.startswith("POST /v1/chat/completions 200 ")
    for part in (
        "request_id=req-7",
        "class=chat",
        "pool=plain",
        "replica=plain-0",
        "reason=",
        "ttft_ms=",
        "attempts=1",
    ):
        assert part in line


def hung_replica(progress: bool = False) -> web.Application:
    """A replica whose engine hangs: its /metrics and /health answer, completions never start."""
    generated = 0

    async def metrics(_: web.Request) -> web.Response:
        nonlocal generated
        generated += progress  # a live engine's counters move
        text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
        return web.Response(text=text + f"vllm:generation_tokens_total {generated}\nvllm:prompt_tokens_total 10\n")

    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", healthy)
    app.router.add_post("/v1/chat/completions", hang)
    return app


async def test_a_hung_replica_is_ejected_and_its_requests_go_elsewhere(fleet: dict[Pool, list[SimProcess]]) -> None:
    async with running_app(hung_replica()) as hung:
        pools = {Pool.SPECULATIVE: [hung], Pool.PLAIN: [fleet[Pool.PLAIN][0].url]}
        fleet_settings = FleetSettings(scrape_interval_s=0.05, hang_after_s=0.5)
        async with running_gateway(settings_for(pools, fleet=fleet_settings)) as url, client(url) as api:
            started = time.monotonic()
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-route-pool": "speculative"}
            )
            # its counters stood still while it held the request: ejected, and the request moved
            assert raw.headers["x-route-replica"] == "plain-0"
            assert time.monotonic() - started < 5.0  # not the 300 s first-byte timeout
            assert await gateway_samples(url, "specgate_replica_up") == {"spec-0": 0.0, "plain-0": 1.0}
            # and it stays out while its /metrics and /health keep answering
            await asyncio.sleep(0.3)
            assert (await gateway_samples(url, "specgate_replica_up"))["spec-0"] == 0.0


async def test_a_first_byte_timeout_is_retried_on_another_replica(fleet: dict[Pool, list[SimProcess]]) -> None:
    async with running_app(hung_replica(progress=True)) as slow:
        pools = {Pool.SPECULATIVE: [slow], Pool.PLAIN: [fleet[Pool.PLAIN][0].url]}
        settings = settings_for(pools, timeouts=Timeouts(first_byte_s=0.3))
        async with running_gateway(settings) as url, client(url) as api:
            raw = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-route-pool": "speculative"}
            )
    assert raw.headers["x-route-replica"] == "plain-0"


async def test_a_pool_that_fails_whole_and_a_busy_replica_do_not_fail_the_request(
    fleet: dict[Pool, list[SimProcess]],
) -> None:
    async def busy(_: web.Request) -> web.Response:
        body = {"error": {"message": "too many requests", "type": "rate_limit_error", "param": None, "code": 429}}
        return web.json_response(body, status=429)

    async with (
        running_app(broken_replica()) as one,
        running_app(broken_replica()) as two,
        running_app(scripted_replica(busy)) as full,
    ):
        pools = {Pool.SPECULATIVE: [one, two, full], Pool.PLAIN: [fleet[Pool.PLAIN][0].url]}
        settings = settings_for(pools, policy=PolicyDocument(policy="round-robin"))
        settings = dataclasses.replace(settings, retries=Retries(max_attempts=4))
        async with running_gateway(settings) as url, client(url) as api:
            for _ in range(4):
                raw = await api.chat.completions.with_raw_response.create(
                    model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"x-route-pool": "speculative"}
                )
                assert raw.headers["x-route-pool"] == "plain"  # served by the other pool every time
            up = await gateway_samples(url, "specgate_replica_up")
    assert up["spec-2"] == 1.0  # answering 429 is being busy, not broken


async def raw_exchange(url: str, data: bytes, read_for: float = 2.0) -> bytes:
    """Send raw bytes on a fresh connection; what comes back before the connection closes."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(1 << 20), read_for)
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("request_head", "status", "code"),
    [
        (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 10_000 + b"\r\n\r\n", 431, "header_too_large"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431,
         "header_too_large"),
        (b"GARBAGE\r\n\r\n", 400, "bad_request"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
         400, "bad_request"),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
         b"Content-Length: 100000000000\r\n\r\n", 413, "body_too_large"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nExpect: a-teapot\r\n\r\n", 417, None),  # refused before any middleware
    ],
)  # fmt: skip
async def test_requests_too_broken_for_a_handler_get_the_openai_error_shape(
    gateway: str, request_head: bytes, status: int, code: str | None
) -> None:
    answer = await raw_exchange(gateway, request_head)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"%d" % status, head[:80]
    assert json.loads(body)["error"]["code"] == code
    assert b"\r\nServer: specgate\r\n" in head + b"\r\n"  # not the framework and its version
    if code is not None:  # counted as the gateway's other errors are, though no handler ran
        assert (await gateway_error_counts(gateway)).get((code, str(status)), 0) >= 1


async def test_every_answer_names_the_product_not_the_framework(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        for method, path, json_body in (("GET", "/health", None), ("GET", "/nowhere", None),
                                        ("POST", "/v1/chat/completions", body),
                                        ("POST", "/v1/chat/completions", {**body, "stream": True})):  # fmt: skip
            async with session.request(method, f"{gateway}{path}", json=json_body) as r:
                await r.read()
                assert r.headers.getall("Server") == ["specgate"], (path, r.headers)


async def test_slow_and_idle_sockets_cannot_take_the_gateway_off_the_air(fleet: dict[Pool, list[SimProcess]]) -> None:
    limits = Limits(header_timeout_s=0.5, body_timeout_s=1.0, idle_timeout_s=5.0, max_connections=20)
    settings = dataclasses.replace(settings_for(urls(fleet)), limits=limits)
    async with running_gateway(settings) as url:
        host, port = url.removeprefix("http://").split(":")
        slow = [await asyncio.open_connection(host, int(port)) for _ in range(20)]
        for _, writer in slow:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        # past the limit: refused at once, in the OpenAI shape
        full = await raw_exchange(url, b"", read_for=1.0)
        assert full.split(b" ")[1] == b"503"
        assert b'"code":"overloaded"' in full
        assert b"\r\nServer: specgate\r\n" in full
        # the slow ones are cut off after the head deadline, with a 408
        answers = await asyncio.gather(*(asyncio.wait_for(reader.read(4096), 3.0) for reader, _ in slow))
        assert all(a.split(b" ")[1] == b"408" for a in answers)
        assert all(b"\r\nServer: specgate\r\n" in a for a in answers)
        for _, writer in slow:
            writer.close()
        # a body promised to a route that needs none: answered, and the socket freed soon after
        started = time.monotonic()
        answer = await raw_exchange(url, b"GET /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}", 5.0)
        assert answer.split(b" ")[1] == b"404"
        assert time.monotonic() - started < 3.0  # closed after a short linger, not held open
        # a body that trickles: 408 when its deadline passes, however steadily it trickles
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")  # fmt: skip
        for _ in range(12):
            await asyncio.sleep(0.1)
            writer.write(b" ")
        answer = await asyncio.wait_for(reader.read(4096), 3.0)
        writer.close()
        assert answer.split(b" ")[1] == b"408"
        assert b'"code":"request_timeout"' in answer
        async with client(url) as api:  # and the gateway serves
            reply = await api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert reply.choices[0].message.content
        errors = await gateway_error_counts(url)
    assert errors[("overloaded", "503")] == 1
    assert errors[("request_timeout", "408")] == 21  # 20 heads, 1 body


async def test_compressed_bodies_and_connection_named_headers() -> None:
    async with (
        running_app(echo_replica()) as replica,
        running_gateway(settings_for({Pool.PLAIN: [replica]})) as url,
    ):
        body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
        headers = {
            "Content-Encoding": "gzip", "Content-Type": "application/json", "Connection": "keep-alive, X-Secret",
            "X-Secret": "hop", "x-api-key": "k", "Cookie": "c=1", "X-Forwarded-For": "10.0.0.1",
        }  # fmt: skip
        status, seen = await post(url, gzip.compress(body), headers)
        assert status == 200
        forwarded = seen["headers"]
        assert seen["body"].encode() == body  # decoded once, and sent on without its encoding
        assert "content-encoding" not in forwarded
        assert "x-secret" not in forwarded  # named in Connection: hop-by-hop
        assert "x-api-key" not in forwarded
        assert "cookie" not in forwarded
        assert forwarded["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
        status, error = await post(url, b"not gzip at all", {"Content-Encoding": "gzip"})
        assert status == 400
        assert error["error"]["code"] == "invalid_body"


async def test_client_keys_authenticate_limit_and_grant_rights(fleet: dict[Pool, list[SimProcess]]) -> None:
    limited = ClientKey(name="limited", sha256=hashed("sg-limited"), rate_per_s=1.0, burst=1)
    ops = ClientKey(name="ops", sha256=hashed("sg-ops"), may_force_pool=True)
    auth = AuthSettings(True, {k.sha256: k for k in (limited, ops)})
    async with running_gateway(settings_for(urls(fleet), auth=auth)) as url, aiohttp.ClientSession() as session:
        chat = f"{url}/v1/chat/completions"

        async def status(key: str | None, extra: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with session.post(chat, data=GOOD, headers={**headers, **(extra or {})}) as r:
                return r.status, json.loads(await r.read())

        assert (await status(None))[0] == 401
        assert (await status("sg-unknown"))[1]["error"]["type"] == "authentication_error"
        assert (await status("sg-limited"))[0] == 200
        code, error = await status("sg-limited")  # its one request per second is spent
        assert (code, error["error"]["code"]) == (429, "rate_limited")
        code, error = await status("sg-ops", {"x-route-pool": "plain"})
        assert code == 200
        await asyncio.sleep(1.0)
        code, error = await status("sg-limited", {"x-route-pool": "plain"})
        assert (code, error["error"]["param"]) == (403, "x-route-pool")
        # a page on another site cannot post in a browser's name
        async with session.post(chat, data=GOOD, headers={"Content-Type": "text/plain",
                                                          "Authorization": "Bearer sg-ops"}) as r:  # fmt: skip
            assert r.status == 415
        async with session.get(f"{url}/ready") as r:
            assert all("url" not in replica for replica in (await r.json())["replicas"].values())
