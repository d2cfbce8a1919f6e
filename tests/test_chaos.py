"""Chaos: the gateway under load while replicas, Redis and clients misbehave.

Each fault is injected by a proxy in front of a simulated replica (or done to the process itself:
a kill, a stop), while clients send a mix of streamed and whole chat and completion requests. The
claim is the same every time: no request that a healthy replica could serve is lost. Every one
gets its whole answer (a stream ends with `[DONE]` and no error event), the healthy replicas are
never ejected, and the gateway keeps serving afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from specgate.calibration.modes import Pool
from specgate.gateway.config import Retries, StoreSettings, Timeouts
from specgate.policies.document import parse
from specgate.testing import RedisServer, SimProcess, running_app
from specgate.workers.pools import FleetSettings
from tests.test_gateway_http import MESSAGES, MODEL, SimFactory, running_gateway, settings_for, sim

pytestmark = pytest.mark.slow

FAULTS = ("hung", "slow", "trickling", "500", "429", "garbage", "not-json", "dies-mid-event", "refuses")


class FaultyReplica:
    """A proxy to a simulated replica that answers requests with `fault` (its /metrics and
    /health pass through, so it looks alive and its load is real)."""

    def __init__(self, upstream: str, fault: str, session: aiohttp.ClientSession) -> None:
        self.upstream = upstream
        self.fault = fault
        self.session = session
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._pass)
        app.router.add_get("/health", self._pass)
        app.router.add_get("/v1/models", self._pass)
        app.router.add_post("/tokenize", self._pass)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        return app

    async def _pass(self, request: web.Request) -> web.Response:
        async with self.session.request(
            request.method, f"{self.upstream}{request.path}", data=await request.read()
        ) as upstream:
            return web.Response(status=upstream.status, body=await upstream.read(), content_type=upstream.content_type)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        fault = self.fault
        if fault == "hung":
            await asyncio.sleep(3600)
        if fault in ("500", "429"):
            body = {"error": {"message": "injected", "type": "server_error", "param": None, "code": int(fault)}}
            return web.json_response(body, status=int(fault))
        if fault == "refuses" and request.transport is not None:
            request.transport.abort()  # the connection drops before an answer
            raise asyncio.CancelledError
        if fault == "garbage" and request.transport is not None:
            request.transport.write(b"\x16\x03\x01 these bytes are not HTTP \r\n\r\n")
            request.transport.close()
            raise asyncio.CancelledError
        if fault == "not-json" and not (await request.json()).get("stream"):
            return web.Response(body=b'{"id": "cut short', content_type="application/json")
        if fault == "slow":
            await asyncio.sleep(0.5)
        return await self._relay(request)

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with self.session.post(f"{self.upstream}{request.path}", data=body, headers=request.headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
            await response.prepare(request)
            sent = 0
            async for chunk in upstream.content.iter_any():
                if self.fault == "trickling":
                    for i in range(0, len(chunk), 16):
                        await response.write(chunk[i : i + 16])
                        await asyncio.sleep(0.005)
                    continue
                if self.fault == "dies-mid-event" and sent > 400 and request.transport is not None:
                    await response.write(chunk[: len(chunk) // 2])
                    request.transport.abort()
                    raise asyncio.CancelledError
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
            return response


def request_mix(count: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        stream = rng.random() < 0.7
        tokens = rng.choice((8, 40, 120))
        body: dict[str, Any] = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "stream": stream}
        if rng.random() < 0.7:
            out.append(("/v1/chat/completions", {**body, "messages": MESSAGES}))
        else:
            out.append(("/v1/completions", {**body, "prompt": "Route me well."}))
    return out


async def send(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> str:
    """'ok' for a whole answer, else what went wrong."""
    try:
        async with session.post(f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            data = await r.read()
            if r.status != 200:
                return f"{r.status} {data[:200]!r}"
            if body["stream"]:
                events = [e for e in data.split(b"\n\n") if e]
                if events[-1] != b"data: [DONE]" or any(b'"error"' in e for e in events):
                    return f"broken stream {data[-300:]!r}"
                tokens = sum(len(json.loads(e[6:])["choices"]) for e in events[:-1] if json.loads(e[6:])["choices"])
                return "ok" if tokens else "empty stream"
            return "ok" if json.loads(data)["choices"] else "no choices"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"client saw {exc!r}"


LOAD_CONCURRENCY = 8


async def load(url: str, count: int = 40, concurrency: int = LOAD_CONCURRENCY, seed: int = 0) -> list[str]:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:

        async def one(path: str, body: dict[str, Any]) -> str:
            async with gate:
                return await send(session, url, path, body)

        return await asyncio.gather(*(one(p, b) for p, b in request_mix(count, seed)))


async def replica_states(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/ready") as r:
        return {name: replica["state"] for name, replica in (await r.json())["replicas"].items()}


CHAOS_FLEET = FleetSettings(scrape_interval_s=0.05, hang_after_s=1.0, base_ejection_s=0.5)


@pytest.fixture(scope="module")
def healthy(sim_factory: SimFactory) -> dict[Pool, SimProcess]:
    return {Pool.SPECULATIVE: sim(sim_factory, "speculative"), Pool.PLAIN: sim(sim_factory, "plain")}


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_sick_replica_loses_no_request(
    sim_factory: SimFactory, healthy: dict[Pool, SimProcess], fault: str
) -> None:
    behind = sim(sim_factory, "speculative")
    async with aiohttp.ClientSession() as session:
        faulty = FaultyReplica(behind.url, fault, session)
        async with running_app(faulty.app()) as sick:
            pools = {Pool.SPECULATIVE: [sick, healthy[Pool.SPECULATIVE].url], Pool.PLAIN: [healthy[Pool.PLAIN].url]}
            # A retry budget as large as the load's concurrency: what is tested here is that every failure
            # is retried elsewhere (the budget that holds a whole fleet's failures back has its own
            # test below). With the default three, a replica failing only some requests stays in, and
            # on a slow machine three retries still being answered make the next failure reach its client.
            settings = settings_for(
                pools, fleet=CHAOS_FLEET, timeouts=Timeouts(first_byte_s=30.0, idle_s=1.0),
                retries=Retries(min_retries=LOAD_CONCURRENCY),
            )  # fmt: skip
            async with running_gateway(settings) as url:
                outcomes = await load(url)
                states = await replica_states(url)
                again = await load(url, count=4, seed=1)
    assert [o for o in outcomes + again if o != "ok"] == []
    assert faulty.requests > 0  # the fault was met, not avoided by luck
    assert states["spec-1"] == states["plain-0"] == "up"  # the healthy ones never paid for it


@pytest.mark.parametrize("ejected", [False, True])
async def test_the_retry_budget_holds_back_retries_only_while_the_failing_replica_serves(
    sim_factory: SimFactory, healthy: dict[Pool, SimProcess], ejected: bool
) -> None:
    # 32 requests at once, round robin over a replica answering 500 and a healthy one: half fail
    # together. While the failing replica stays in (it is never ejected here), at most three
    # retries run at once and the rest of the failures reach their clients: a fleet failing whole
    # is not hit by a storm of retries. Once its failure ejects it, retrying moves load off it.
    behind = sim(sim_factory, "speculative")
    round_robin = parse({"schema_version": 1, "policy": "round-robin"})
    never = dataclasses.replace(CHAOS_FLEET, eject_after=10_000, failure_window=10_000)
    fleet = dataclasses.replace(CHAOS_FLEET, eject_after=1) if ejected else never
    async with aiohttp.ClientSession() as session:
        faulty = FaultyReplica(behind.url, "500", session)
        async with running_app(faulty.app()) as sick:
            pools = {Pool.SPECULATIVE: [sick], Pool.PLAIN: [healthy[Pool.PLAIN].url]}
            async with running_gateway(settings_for(pools, fleet=fleet, policy=round_robin)) as url:
                outcomes = await load(url, count=32, concurrency=32)
    failed = [o for o in outcomes if o != "ok"]
    if ejected:
        assert failed == []
    else:
        assert failed
        assert all(o.startswith("502") and "answered 500" in o for o in failed), failed
        assert len(failed) < 16


async def test_a_replica_killed_under_load_loses_no_request(
    sim_factory: SimFactory, healthy: dict[Pool, SimProcess]
) -> None:
    doomed = sim(sim_factory, "speculative")
    pools = {Pool.SPECULATIVE: [doomed.url, healthy[Pool.SPECULATIVE].url], Pool.PLAIN: [healthy[Pool.PLAIN].url]}
    async with running_gateway(settings_for(pools, fleet=CHAOS_FLEET)) as url:
        running = asyncio.create_task(load(url, count=60, concurrency=12))
        await asyncio.sleep(0.5)
        doomed.proc.send_signal(signal.SIGKILL)
        outcomes = await running
    assert [o for o in outcomes if o != "ok"] == []


async def test_client_abort_storms_cost_bystanders_nothing(healthy: dict[Pool, SimProcess]) -> None:
    pools = {pool: [s.url] for pool, s in healthy.items()}
    long = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with running_gateway(settings_for(pools, fleet=CHAOS_FLEET)) as url:

        async def abort(session: aiohttp.ClientSession) -> None:
            async with session.post(f"{url}/v1/chat/completions", json=long) as r:
                await r.content.readany()  # then leaves mid-stream

        async with aiohttp.ClientSession() as session:
            storm = asyncio.gather(*(abort(session) for _ in range(200)))
            outcomes = await load(url, count=30)
            await storm
        states = await replica_states(url)
    assert [o for o in outcomes if o != "ok"] == []
    assert set(states.values()) == {"up"}


async def test_slowloris_beside_real_clients(healthy: dict[Pool, SimProcess]) -> None:
    pools = {pool: [s.url] for pool, s in healthy.items()}
    async with running_gateway(settings_for(pools)) as url:
        host, port = url.removeprefix("http://").split(":")
        slow = [await asyncio.open_connection(host, int(port)) for _ in range(300)]
        for _, writer in slow:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        outcomes = await load(url, count=30)
        for _, writer in slow:
            writer.close()
    assert [o for o in outcomes if o != "ok"] == []


async def stopped(redis: RedisServer, seconds: float) -> None:
    """Redis hung: it holds its connections and answers nothing."""
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("fault", ["hung", "killed"])
async def test_redis_going_away_loses_no_request(
    healthy: dict[Pool, SimProcess], redis_server: RedisServer, fault: str
) -> None:
    pools = {pool: [s.url] for pool, s in healthy.items()}
    settings = settings_for(pools, store=StoreSettings(url=redis_server.url, refresh_s=0.1))
    actions: dict[str, Callable[[], Awaitable[None]]] = {
        "hung": lambda: stopped(redis_server, 2.0),
        "killed": lambda: asyncio.to_thread(redis_server.stop),
    }
    async with running_gateway(settings) as url:
        running = asyncio.create_task(load(url, count=40, concurrency=8))
        await asyncio.sleep(0.2)
        await actions[fault]()
        outcomes = await running
        again = await load(url, count=4, seed=1)
    assert [o for o in outcomes + again if o != "ok"] == []
