"""The count exchange between gateways, through a real redis-server."""

from __future__ import annotations

import time
from pathlib import Path

import redis.asyncio as aioredis

from specgate.calibration.modes import Pool
from specgate.gateway.exchange import CountExchange, ExchangeSettings
from specgate.testing import RedisServer
from specgate.workers.pools import Fleet, FleetSettings
from specgate.workers.shared import SharedCounts

URLS = {Pool.PLAIN: ["http://10.0.0.1:8000"]}
WINDOWS = (FleetSettings().rate_window_s, FleetSettings().burst_window_s)


def exchanging(tmp_path: Path, redis: RedisServer) -> tuple[Fleet, CountExchange]:
    counts = SharedCounts(SharedCounts.create(1, tmp_path, others=True), 1, 0, others=True)
    return Fleet(URLS, FleetSettings(), counts), CountExchange(redis.url, "t", counts, WINDOWS, ExchangeSettings())


async def test_gateways_count_each_other_until_one_leaves(tmp_path: Path, redis_server: RedisServer) -> None:
    (first, first_exchange), (second, second_exchange) = (exchanging(tmp_path, redis_server) for _ in range(2))
    try:
        for _ in range(3):
            first.replicas["plain-0"].dispatched_one(100)
        first.hold(2)  # requests it holds that can still meet their targets
        await first_exchange.once()
        await second_exchange.once()
        assert second.snapshot(time.monotonic()).replicas[0].in_flight == 3
        assert second.held_elsewhere() == 2
        assert first.shared is not None
        assert first.shared.gateways_counted() == 0  # it read before the second wrote
        await first_exchange.once()
        assert first.shared.gateways_counted() == 1
        async with aioredis.Redis.from_url(redis_server.url) as client:
            assert await client.hlen("t:gateways") == 2
            assert 0 < await client.pttl("t:gateways") <= 60_000  # gone a minute after the last gateway
        await first_exchange.close()  # a gateway that stops leaves at once, not once its counts are stale
        await second_exchange.once()
        assert second.snapshot(time.monotonic()).replicas[0].in_flight == 0
        assert second.held_elsewhere() == 0
    finally:
        await second_exchange.close()
