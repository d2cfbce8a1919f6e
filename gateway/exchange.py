"""Counts exchanged with the other gateways in front of the same fleet, through the policy's Redis.

A gateway knows its own dispatches at once and another gateway's only when a scrape shows them in
a replica's batch: between two scrapes, gateways behind one load balancer can all send to the
replica that looked idle (the herd effect). So every `interval_s` the gateway's first process
writes a summary of what its processes count (`workers/shared.py`: per replica the requests in
flight, still prefilling, dispatched, their rates; per pool the step-cost fit's sums and the
correction factors) into one hash field of `{prefix}:gateways`, reads everyone else's in the same
round trip, and sums them into the row of its shared counts kept for other gateways, where each of
its processes counts them as it counts a sibling's. Each gateway then sees the fleet as one
gateway would, a round trip and at most `interval_s` late. (In the offline simulator, 3 gateways
exchanging every 50 ms met 1.6 points fewer SLOs than one, each counting its share of the fleet's
3.5: `specgate bench herd`; the shorter the interval, the less they lose under storms.)

The cost is bounded: one pipelined write and read per interval, a summary of 8 bytes per field,
16 fields per replica, with at most `gateways` summaries read. A summary older than `stale_s` (its
gateway died, or its clock is off) is not counted; one a minute old is deleted by whoever finds it.
While Redis is away, the others' rows are dropped once they are stale: each gateway falls back to
counting its requests as its share of the fleet's (`workers.pools.Share`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions

from specgate.workers.shared import SharedCounts, taken_at

_log = logging.getLogger(__name__)

FORGET_S = 60.0
"""A summary this old is deleted from the hash: its gateway is gone."""
MAX_BACKOFF_S = 2.0


@dataclass(frozen=True)
class ExchangeSettings:
    interval_s: float = 0.05
    """How often a gateway writes its counts and reads the others'; 0 turns the exchange off."""
    gateways: int = 8
    """Gateways counted, this one included (the others' summaries read are summed, a bounded work)."""
    stale_s: float = 2.0
    """A summary older than this is not counted."""

    def on(self, store_url: str | None) -> bool:
        """Whether counts are exchanged: through a store, unless turned off."""
        return store_url is not None and self.interval_s > 0


def gateway_name() -> str:
    """This gateway's field in the hash: its host, its process and a nonce (a restarted gateway is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class CountExchange:
    def __init__(
        self, url: str, prefix: str, counts: SharedCounts, windows: tuple[float, ...], settings: ExchangeSettings,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:  # fmt: skip
        self.client = aioredis.Redis.from_url(  # bytes, not text: summaries are binary
            url, socket_timeout=max(4 * settings.interval_s, 0.5), socket_connect_timeout=2.0
        )
        self.key = f"{prefix}:gateways"
        self.counts = counts
        self.windows = windows
        self.settings = settings
        self.on_failure = on_failure
        self.name = gateway_name()
        self._gone: list[bytes] = []
        """Fields found a minute old at the last round: deleted at the next."""

    async def once(self) -> None:
        """One round: this gateway's summary written, everyone's read and taken."""
        now, wall = time.monotonic(), time.time()
        summary = self.counts.summary(now, self.windows, wall)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(self.key, self.name, summary)
            pipe.pexpire(self.key, int(FORGET_S * 1e3))
            if self._gone:
                pipe.hdel(self.key, *self._gone)
            pipe.hgetall(self.key)
            replies = await pipe.execute()
        found: dict[bytes, bytes] = replies[-1]
        now, wall = time.monotonic(), time.time()
        summaries = {name.decode(errors="replace"): value for name, value in found.items()}
        s = self.settings
        self.counts.take_all(self.name, summaries, now, wall, self.windows, s.stale_s, most=s.gateways - 1)
        self._gone = [name for name, value in found.items() if _forgotten(value, wall)]

    async def run(self) -> None:
        failures, ok_at = 0, time.monotonic()
        while True:
            try:
                await self.once()
                if failures:
                    _log.warning("exchanging counts with the other gateways again, after %d failed rounds", failures)
                failures, ok_at = 0, time.monotonic()
            except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
                self.on_failure()
                if failures == 0:
                    _log.warning("cannot exchange counts with the other gateways through Redis: %s", exc)
                failures += 1
                if time.monotonic() - ok_at > self.settings.stale_s:
                    self.counts.forget()  # the others' counts are stale: count this gateway's share instead
            backoff = min(self.settings.interval_s * 2.0**failures, MAX_BACKOFF_S) if failures else 0.0
            await asyncio.sleep(max(self.settings.interval_s, backoff))

    async def close(self) -> None:
        """Leave the hash (the others stop counting this gateway at once) and disconnect."""
        with contextlib.suppress(redis.exceptions.RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.client.hdel(self.key, self.name), timeout=1.0)
        await self.client.aclose()


def _forgotten(summary: bytes, wall: float) -> bool:
    at = taken_at(summary)  # (not a summary: another version's, perhaps; left to the hash's expiry)
    return at is not None and wall - at > FORGET_S
