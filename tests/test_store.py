"""The policy store against a real redis-server: versions, compare-and-set, history, rollback, announcements."""

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from specgate.gateway.store import PolicyStore, VersionConflict
from specgate.policies.document import PolicyDocument, parse
from specgate.testing import RedisServer


def doc(policy: str = "least-loaded", **changes: object) -> PolicyDocument:
    return parse({"schema_version": 1, "policy": policy, **changes})


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[PolicyStore]:
    s = PolicyStore.connect(redis_server.url, "test")
    yield s
    await s.close()


async def test_set_get_history(store: PolicyStore) -> None:
    assert await store.current() is None
    first = await store.write(doc(), expected_version=0, who="alice", why="start")
    second = await store.write(doc("round-robin"), expected_version=1, who="bob", why="try rr")
    assert (first.version, second.version) == (1, 2)
    current = await store.current()
    assert current is not None
    assert (current.version, current.who, current.why) == (2, "bob", "try rr")
    assert current.parsed() == doc("round-robin")
    assert current.when == pytest.approx(second.when, abs=1e-3)
    history = await store.history()
    assert [(r.version, r.who) for r in history] == [(2, "bob"), (1, "alice")]
    assert history[1].parsed() == doc()


async def test_compare_and_set_detects_a_concurrent_change(store: PolicyStore) -> None:
    await store.write(doc(), expected_version=0, who="alice", why="")
    # Both operators read version 1; the second write must not silently replace the first.
    await store.write(doc("round-robin"), expected_version=1, who="alice", why="")
    with pytest.raises(VersionConflict) as exc:
        await store.write(doc("plain-only"), expected_version=1, who="bob", why="")
    assert (exc.value.expected, exc.value.current) == (1, 2)
    current = await store.current()
    assert current is not None
    assert current.parsed().policy == "round-robin"
    # Writing with no expectation overwrites whatever is there.
    assert (await store.write(doc("plain-only"), expected_version=None, who="bob", why="")).version == 3


async def test_concurrent_writers_get_distinct_versions_and_one_winner_per_version(store: PolicyStore) -> None:
    await store.write(doc(), expected_version=0, who="seed", why="")
    results = await asyncio.gather(
        *(store.write(doc(), expected_version=1, who=f"w{i}", why="") for i in range(10)), return_exceptions=True
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1
    assert winners[0].version == 2
    assert all(isinstance(r, VersionConflict) for r in results if r not in winners)


async def test_rollback_writes_the_old_document_as_a_new_version(store: PolicyStore) -> None:
    await store.write(doc(), expected_version=0, who="a", why="")
    await store.write(doc("round-robin", exploration=0.1), expected_version=1, who="a", why="")
    rolled = await store.rollback(1, who="ops")
    assert rolled.version == 3
    assert rolled.why == "rollback to version 1"
    current = await store.current()
    assert current is not None
    assert current.parsed() == doc()
    with pytest.raises(KeyError):
        await store.rollback(99, who="ops")


async def test_history_is_bounded(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    store = PolicyStore(client, "bounded", history_limit=5)
    try:
        for v in range(12):
            await store.write(doc(exploration=v / 100), expected_version=v, who="a", why=str(v))
        assert [r.version for r in await store.history()] == [12, 11, 10, 9, 8]
        assert await store.at(3) is None
    finally:
        await store.close()


async def test_prefixes_keep_deployments_apart(redis_server: RedisServer) -> None:
    blue, green = PolicyStore.connect(redis_server.url, "blue"), PolicyStore.connect(redis_server.url, "green")
    try:
        await blue.write(doc("round-robin"), expected_version=0, who="a", why="")
        assert await green.current() is None
        await green.write(doc("plain-only"), expected_version=0, who="a", why="")
        b, g = await blue.current(), await green.current()
        assert b is not None
        assert g is not None
        assert (b.parsed().policy, g.parsed().policy) == ("round-robin", "plain-only")
    finally:
        await blue.close()
        await green.close()


async def test_every_write_is_announced(store: PolicyStore) -> None:
    async with store.client.pubsub() as pubsub:
        await pubsub.subscribe(store.channel)
        await store.write(doc(), expected_version=0, who="a", why="")
        message = None
        for _ in range(50):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if message:
                break
        assert message is not None
        assert message["data"] == "1"
