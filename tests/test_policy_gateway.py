"""A gateway changing its policy live: the admin API, following Redis, the local cache, Redis going away."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from specgate.calibration import profile_file
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import H100_LLAMA31_8B
from specgate.gateway.app import make_app
from specgate.gateway.config import GatewaySettings, StoreSettings
from specgate.gateway.store import PolicyStore
from specgate.policies.document import PolicyDocument, parse
from specgate.testing import RedisServer, SimProcess, running_app, sample_value
from specgate.workers.pools import FleetSettings

MODEL = "sim-model"
TOKEN = "admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
BODY = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


@pytest.fixture(scope="module")
def fleet(sim_factory: Callable[..., SimProcess]) -> dict[Pool, tuple[str, ...]]:
    args = ("--model", MODEL, "--time-scale", "20")
    spec, plain = sim_factory("--mode", "speculative", *args), sim_factory("--mode", "plain", *args)
    return {Pool.SPECULATIVE: (spec.url,), Pool.PLAIN: (plain.url,)}


def settings(fleet: dict[Pool, tuple[str, ...]], **changes: Any) -> GatewaySettings:
    base = GatewaySettings(
        models=(MODEL,), pools=fleet, port=0, admin_token=TOKEN, fleet=FleetSettings(scrape_interval_s=0.05)
    )
    return dataclasses.replace(base, **changes)


def document(**changes: Any) -> PolicyDocument:
    return parse({"schema_version": 1, "policy": "least-loaded", **changes})


def drained(pool: Pool) -> PolicyDocument:
    return document(pools={pool.value: {"drain": True}})


CALL_TIMEOUT_S = 30.0
"""The most any one call through the gateway may take in these tests."""


@contextlib.asynccontextmanager
async def gateway(s: GatewaySettings) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    # Every call through the gateway has a deadline: one that hangs fails where it hangs, not at
    # the whole test's timeout with nothing but the event loop's wait on its stack.
    limit = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
    async with running_app(make_app(s)) as url, aiohttp.ClientSession(timeout=limit) as session:
        yield url, session


async def chat(session: aiohttp.ClientSession, url: str) -> tuple[int, str, str]:
    """Status, policy version and pool of one request."""
    async with session.post(f"{url}/v1/chat/completions", data=BODY, headers={"content-type": "application/json"}) as r:
        await r.read()
        return r.status, r.headers.get("x-policy-version", ""), r.headers.get("x-route-pool", "")


async def wait_for_version(session: aiohttp.ClientSession, url: str, version: int, within_s: float = 5.0) -> str:
    """The pool that served the first request answered under `version`."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        status, seen, pool = await chat(session, url)
        assert status == 200
        if seen == str(version):
            return pool
        assert asyncio.get_running_loop().time() < deadline, f"still at version {seen}, waiting for {version}"
        await asyncio.sleep(0.02)


async def metric(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float | None:
    async with session.get(f"{url}/metrics") as r:
        return sample_value(await r.text(), name, **labels)


async def put(
    session: aiohttp.ClientSession, url: str, body: bytes, if_match: str | None, **headers: str
) -> tuple[int, dict[str, Any]]:
    h = {**AUTH, **headers, **({"if-match": if_match} if if_match is not None else {})}
    async with session.put(f"{url}/admin/policy", data=body, headers=h) as r:
        return r.status, await r.json()


# --- the admin API, policy in memory ---------------------------------------------------------------


async def test_admin_api_is_off_without_a_token(fleet: dict[Pool, tuple[str, ...]]) -> None:
    async with gateway(settings(fleet, admin_token=None)) as (url, session):
        async with session.get(f"{url}/admin/policy", headers=AUTH) as r:
            assert r.status == 404
        assert (await chat(session, url))[:2] == (200, "0")


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}", TOKEN])
async def test_admin_api_refuses_a_bad_token(fleet: dict[Pool, tuple[str, ...]], authorization: str | None) -> None:
    headers = {"authorization": authorization} if authorization else {}
    async with gateway(settings(fleet)) as (url, session):
        for method in ("GET", "PUT"):
            async with session.request(method, f"{url}/admin/policy", headers=headers, data=b"{}") as r:
                assert r.status == 401
                assert (await r.json())["error"]["type"] == "authentication_error"


async def test_admin_api_changes_the_policy_in_memory(fleet: dict[Pool, tuple[str, ...]]) -> None:
    async with gateway(settings(fleet)) as (url, session):
        async with session.get(f"{url}/admin/policy", headers=AUTH) as r:
            current = await r.json()
        assert (current["version"], current["store"], current["document"]["policy"]) == (0, "memory", "adaptive")

        body = drained(Pool.SPECULATIVE).dumps()
        status, error = await put(session, url, body, None)
        assert (status, error["error"]["param"]) == (428, "If-Match")
        status, error = await put(session, url, b'{"schema_version": 1, "pools": {"plain": {"weight": -1}}}', "0")
        assert (status, error["error"]["param"]) == (400, "pools.plain.weight")
        assert (await put(session, url, b" " * (1024 * 1024 + 1), "0"))[0] == 400  # over a megabyte
        status, error = await put(session, url, b"{not json", "0")
        assert (status, error["error"]["type"]) == (400, "invalid_request_error")
        assert (await chat(session, url))[1] == "0"  # the invalid documents changed nothing

        status, applied = await put(session, url, body, "0", **{"x-change-reason": "spec pool misbehaves"})
        assert status == 200
        assert (applied["version"], applied["why"]) == (1, "spec pool misbehaves")
        for _ in range(5):
            assert await chat(session, url) == (200, "1", "plain")
        status, error = await put(session, url, document().dumps(), "0")  # stale: the version is 1 now
        assert (status, error["error"]["param"]) == (409, "If-Match")
        assert (await put(session, url, document().dumps(), "*"))[0] == 200
        assert (await chat(session, url))[1] == "2"
        assert await metric(session, url, "specgate_policy_version") == 2.0


async def test_the_document_moves_a_replica_to_the_other_pool_and_drains_one(
    fleet: dict[Pool, tuple[str, ...]],
) -> None:
    """What `specgate pools switch` does to every gateway: drain the server, then re-admit it in
    the other pool once restarted."""
    spec_url, plain_url = fleet[Pool.SPECULATIVE][0], fleet[Pool.PLAIN][0]

    async def routes(n: int) -> set[tuple[str, str]]:
        seen = set()
        for _ in range(n):
            async with session.post(f"{url}/v1/chat/completions", data=BODY, headers=JSON) as r:
                assert r.status == 200
                await r.read()
                seen.add((r.headers["x-route-pool"], r.headers["x-route-replica"]))
        return seen

    JSON = {"content-type": "application/json"}
    async with gateway(settings(fleet, policy=document(policy="speculative-only"))) as (url, session):
        assert await routes(4) == {("speculative", "spec-0")}
        moved = document(policy="speculative-only", replicas={plain_url: {"pool": "speculative"}})
        assert (await put(session, url, moved.dumps(), "0"))[0] == 200
        await asyncio.sleep(0.2)  # a scrape or two: the moved replica is admitted afresh
        assert await routes(8) == {("speculative", "spec-0"), ("speculative", "plain-0")}
        drained = document(
            policy="speculative-only", replicas={plain_url: {"pool": "speculative"}, spec_url: {"drain": True}}
        )
        assert (await put(session, url, drained.dumps(), "1"))[0] == 200
        assert await routes(4) == {("speculative", "plain-0")}
        async with session.get(f"{url}/admin/fleet", headers=AUTH) as r:
            view = {rep["name"]: rep for rep in (await r.json())["replicas"]}
        assert (view["spec-0"]["drained"], view["spec-0"]["available"]) == (True, False)
        assert (view["plain-0"]["pool"], view["plain-0"]["drained"]) == ("speculative", False)


async def test_a_document_may_name_a_profile_the_gateway_loaded_from_a_file(fleet: dict[Pool, tuple[str, ...]]) -> None:
    mine = dataclasses.replace(H100_LLAMA31_8B, name="my-fleet", title="measured on this fleet")
    profiles = profile_file.with_files([profile_file.ProfileFile(mine, "a test", datetime.date(2026, 12, 1))])
    naming = b'{"schema_version": 1, "policy": "adaptive", "profile": "my-fleet"}'
    async with gateway(settings(fleet)) as (url, session):  # a gateway without the file refuses it
        status, error = await put(session, url, naming, "*")
        assert (status, error["error"]["param"]) == (400, "profile")
    async with gateway(settings(fleet, profiles=profiles)) as (url, session):
        status, applied = await put(session, url, naming, "*")
        assert (status, applied["document"]["profile"]) == (200, "my-fleet")
        async with session.post(
            f"{url}/v1/chat/completions",
            data=BODY,
            headers={"content-type": "application/json", "x-slo-ttft-ms": "9000"},
        ) as r:
            assert r.status == 200
            # Predicted by the file's profile: the 8B model on an H100, not the default 34B one.
            assert float(r.headers["x-predicted-tpot-ms"]) < 15


# --- following Redis -------------------------------------------------------------------------------


async def test_gateway_follows_the_store_and_rejects_invalid_documents(
    fleet: dict[Pool, tuple[str, ...]], redis_server: RedisServer
) -> None:
    store = PolicyStore.connect(redis_server.url, "t")
    s = settings(fleet, store=StoreSettings(url=redis_server.url, prefix="t", refresh_s=0.5))
    try:
        async with gateway(s) as (url, session):
            assert (await chat(session, url))[1] == "0"  # an empty store: the configured policy
            assert await metric(session, url, "specgate_policy_store_up") == 1.0
            await store.write(drained(Pool.PLAIN), expected_version=0, who="test", why="")
            assert await wait_for_version(session, url, 1) == "speculative"

            # A document that bypassed validation never replaces the one in force, nor does a
            # record that is not one (written by hand, without a version).
            await store.client.hset(store.key, mapping={"version": "two"})
            await asyncio.sleep(1.0)  # past a refresh
            assert await chat(session, url) == (200, "1", "speculative")
            await store.client.hset(store.key, mapping={"version": 2, "document": '{"schema_version": 9}'})
            await asyncio.sleep(1.0)
            assert await chat(session, url) == (200, "1", "speculative")
            assert await metric(session, url, "specgate_policy_changes_total", outcome="rejected") == 2.0
            assert await metric(session, url, "specgate_policy_store_up") == 1.0

            # Through the admin API, the change goes to the store, and from there to every gateway.
            status, applied = await put(session, url, drained(Pool.SPECULATIVE).dumps(), "2")
            assert (status, applied["version"], applied["store"]) == (200, 3, "redis")
            assert (await chat(session, url))[1:] == ("3", "plain")
            current = await store.current()
            assert current is not None
            assert current.version == 3
            status, _ = await put(session, url, document().dumps(), "2")
            assert status == 409
    finally:
        await store.close()


async def test_redis_lost_and_back(fleet: dict[Pool, tuple[str, ...]], redis_server: RedisServer) -> None:
    store = PolicyStore.connect(redis_server.url, "t")
    s = settings(fleet, store=StoreSettings(url=redis_server.url, prefix="t", refresh_s=0.2))
    try:
        await store.write(drained(Pool.PLAIN), expected_version=0, who="test", why="")
        async with gateway(s) as (url, session):
            assert await wait_for_version(session, url, 1) == "speculative"
            redis_server.stop()
            await asyncio.sleep(0.5)
            # Serving goes on with the document it has; the admin API says the store is away.
            for _ in range(5):
                assert await chat(session, url) == (200, "1", "speculative")
            assert await metric(session, url, "specgate_policy_store_up") == 0.0
            status, error = await put(session, url, document().dumps(), "1")
            assert status == 503
            assert "store" in error["error"]["message"]

            redis_server.start()  # an empty Redis (no persistence): the gateway keeps what it has
            await asyncio.sleep(0.5)
            assert await chat(session, url) == (200, "1", "speculative")
            # Version 1 again in the new Redis, with another document: the store is the truth.
            await store.write(drained(Pool.SPECULATIVE), expected_version=0, who="test", why="")
            for _ in range(250):
                if await chat(session, url) == (200, "1", "plain"):
                    break
                await asyncio.sleep(0.02)
            assert await chat(session, url) == (200, "1", "plain")
            assert await metric(session, url, "specgate_policy_store_up") == 1.0
    finally:
        await store.close()


async def test_a_redis_that_answers_with_errors_is_a_store_away(
    fleet: dict[Pool, tuple[str, ...]], redis_server: RedisServer
) -> None:
    # A Redis that is up but refuses the gateway every command (an ACL denying its user; a Redis in
    # protected mode answers outside clients likewise, with DENIED): the gateway starts, serves
    # with what it has, says the store is away, and follows it again once the Redis lets it in.
    admin_url = redis_server.url.replace("redis://", "redis://root:root-secret@")
    root = aioredis.Redis.from_url(redis_server.url)
    await root.acl_setuser(
        "root", enabled=True, passwords=["+root-secret"], keys=["*"], channels=["*"], commands=["+@all"]
    )
    await root.acl_setuser("default", enabled=True, commands=["-@all", "+ping"])
    await root.aclose()
    root = aioredis.Redis.from_url(admin_url)
    store = PolicyStore.connect(admin_url, "t")
    s = settings(fleet, store=StoreSettings(url=redis_server.url, prefix="t", refresh_s=0.2))
    try:
        await store.write(drained(Pool.PLAIN), expected_version=0, who="test", why="")
        async with gateway(s) as (url, session):
            for _ in range(5):
                assert (await chat(session, url))[:2] == (200, "0")
            assert await metric(session, url, "specgate_policy_store_up") == 0.0
            status, error = await put(session, url, document().dumps(), "0")
            assert status == 503
            assert "no permissions" in error["error"]["message"]
            await root.acl_setuser("default", enabled=True, keys=["*"], channels=["*"], commands=["+@all"])
            assert await wait_for_version(session, url, 1) == "speculative"
            assert await metric(session, url, "specgate_policy_store_up") == 1.0
    finally:
        await store.close()
        await root.aclose()


async def test_redis_down_at_start_serves_the_cached_document(
    fleet: dict[Pool, tuple[str, ...]], redis_server: RedisServer, tmp_path: Path
) -> None:
    cache = tmp_path / "policy.json"
    store_settings = StoreSettings(url=redis_server.url, prefix="t", cache=cache, refresh_s=0.2)
    store = PolicyStore.connect(redis_server.url, "t")
    try:
        await store.write(document(), expected_version=0, who="test", why="")
        await store.write(drained(Pool.PLAIN), expected_version=1, who="test", why="drain plain")
        async with gateway(settings(fleet, store=store_settings)) as (url, session):
            assert await wait_for_version(session, url, 2) == "speculative"
        assert orjson.loads(cache.read_bytes())["version"] == 2
    finally:
        await store.close()
    redis_server.stop()
    async with gateway(settings(fleet, store=store_settings)) as (url, session):
        assert await chat(session, url) == (200, "2", "speculative")
        assert await metric(session, url, "specgate_policy_store_up") == 0.0
    # Without a cache, Redis down at start: the configured policy.
    async with gateway(settings(fleet, store=dataclasses.replace(store_settings, cache=None))) as (url, session):
        assert (await chat(session, url))[:2] == (200, "0")


async def test_unreachable_redis_never_delays_a_request(fleet: dict[Pool, tuple[str, ...]], tmp_path: Path) -> None:
    # A port nobody listens on: connecting fails at once; the gateway serves and retries in the background.
    s = settings(fleet, store=StoreSettings(url="redis://127.0.0.1:9/0", refresh_s=0.1))
    async with gateway(s) as (url, session):
        started = asyncio.get_running_loop().time()
        for _ in range(10):
            assert (await chat(session, url))[:2] == (200, "0")
        assert asyncio.get_running_loop().time() - started < 5.0
    client = aioredis.Redis.from_url("redis://127.0.0.1:9/0")
    await client.aclose()
