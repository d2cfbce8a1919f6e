"""The policy document in force on this gateway, kept in step with its store.

Without a store the document lives in memory: the admin API changes it, versions count up from
the configured one (0). With Redis, Redis is the truth: the gateway applies the store's document
when it starts and whenever a change is announced on the channel, and re-reads it every
`refresh_s` as well, because pub/sub drops announcements while a connection is re-made. When
Redis cannot be reached the gateway keeps serving the document it has (at start: the local cache
of the last good one, else the configured one) and retries with backoff. A document that fails
validation is never applied; the one in force stays.

Applying compiles the document once and swaps the plan in with one assignment (`plan`, which the
relay reads once per request): a request in flight keeps the plan it started with.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis.exceptions

from specgate.calibration.profiles import PROFILES, Profile
from specgate.gateway.metrics import GatewayMetrics
from specgate.gateway.store import PolicyStore, StoredPolicy, VersionConflict
from specgate.policies.document import DocumentError, PolicyDocument
from specgate.policies.document import parse as parse_document
from specgate.policies.registry import RoutingPlan
from specgate.workers.pools import Fleet

_log = logging.getLogger(__name__)

STORE_ERRORS = (redis.exceptions.RedisError, OSError)
"""What a store that is away or will not serve the gateway raises: unreachable, timing out, or
answering with an error (a Redis in protected mode that refuses outside clients, an ACL that
denies the gateway's user, a read-only replica, a key of another type)."""
MAX_BACKOFF_S = 2.0


@dataclass(frozen=True)
class Applied:
    version: int
    document: PolicyDocument
    who: str = ""
    when: float = 0.0
    why: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "document": self.document.to_json(),
            "who": self.who,
            "when": self.when,
            "why": self.why,
        }


class PolicyControl:
    plan: RoutingPlan
    """The plan in force, compiled once from the current document."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        initial: PolicyDocument,
        store: PolicyStore | None = None,
        cache: Path | None = None,
        refresh_s: float = 1.0,
        profiles: Mapping[str, Profile] = PROFILES,
        fleet: Fleet | None = None,
    ) -> None:
        self.metrics = metrics
        self.fleet = fleet
        """Arranged as each document's `replicas` say, when one is installed."""
        self.profiles = profiles
        """The profiles a document may name: the built-in ones and those loaded from files."""
        self.store = store
        self.cache = cache
        self.refresh_s = refresh_s
        self.store_up = False
        self._held: tuple[int, str] = (-1, "")
        self._rejected: tuple[int, str] | None = None
        self.current = self._cached() or Applied(0, initial, "config", 0.0, "the gateway's configuration")
        self._install(self.current)

    # --- applying ------------------------------------------------------------------------------

    def _install(self, applied: Applied) -> None:
        self.plan = applied.document.compile(str(applied.version), self.profiles)
        if self.fleet is not None:
            self.fleet.arrange(applied.document.replica_pools(), applied.document.drained_replicas())
        self.current = applied
        self._held = (applied.version, applied.document.dumps().decode())
        self.metrics.policy_version.set(applied.version)

    @property
    def source(self) -> str:
        return "redis" if self.store is not None else "memory"

    def _adopt(self, applied: Applied) -> None:
        self._install(applied)
        self.metrics.policy_changes.labels("applied").inc()
        _log.info("policy version %d applied (%s: %s)", applied.version, applied.who, applied.why)

    def _apply_stored(self, stored: StoredPolicy, document: PolicyDocument | None = None) -> None:
        """Apply what the store holds; `document`, when given, is `stored.document` already parsed."""
        # Whatever the store holds is the truth, even an older version (a Redis restored from a
        # backup, or restarted empty and written again): compare the document, not just the number.
        seen = (stored.version, stored.document)
        if seen in (self._held, self._rejected):
            return
        try:
            applied = Applied(
                stored.version, document or stored.parsed(self.profiles), stored.who, stored.when, stored.why
            )
        except DocumentError as exc:
            self._rejected = seen  # counted and logged once, not on every re-read
            self.metrics.policy_changes.labels("rejected").inc()
            _log.error("policy version %d in the store is invalid, keeping version %d: %s",
                       stored.version, self.current.version, exc)  # fmt: skip
            return
        self._adopt(applied)
        self._write_cache(applied)

    async def update(self, document: PolicyDocument, *, expected_version: int | None, who: str, why: str) -> Applied:
        """Make `document` the policy: in the store (every gateway follows) or, without one, here."""
        if self.store is not None:
            stored = await self.store.write(document, expected_version=expected_version, who=who, why=why)
            self._apply_stored(stored, document)  # at once here; the other gateways hear of it
            return self.current
        if expected_version is not None and expected_version != self.current.version:
            raise VersionConflict(expected_version, self.current.version)
        self._adopt(Applied(self.current.version + 1, document, who, time.time(), why))
        return self.current

    # --- the local cache -----------------------------------------------------------------------

    def _cached(self) -> Applied | None:
        if self.cache is None or not self.cache.exists():
            return None
        try:
            record = orjson.loads(self.cache.read_bytes())
            return Applied(
                int(record["version"]),
                parse_document(record["document"], profiles=self.profiles),
                str(record.get("who", "")),
                float(record.get("when", 0.0)),
                str(record.get("why", "")),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            _log.warning("ignoring the policy cache %s: %s", self.cache, exc)
            return None

    def _write_cache(self, applied: Applied) -> None:
        # A few kilobytes, written only when the version changes: not worth a thread.
        if self.cache is None:
            return
        tmp = self.cache.with_name(self.cache.name + ".tmp")
        try:
            tmp.write_bytes(orjson.dumps(applied.to_json()))
            os.replace(tmp, self.cache)
        except OSError as exc:
            _log.warning("cannot write the policy cache %s: %s", self.cache, exc)

    # --- following the store -------------------------------------------------------------------

    async def resync(self) -> None:
        assert self.store is not None
        try:
            stored = await self.store.current()
        except (KeyError, ValueError) as exc:  # a record not written by specgate: never applied
            if self._rejected != (-1, repr(exc)):
                self._rejected = (-1, repr(exc))
                self.metrics.policy_changes.labels("rejected").inc()
                _log.error("the policy record in the store is malformed, keeping version %d: %r",
                           self.current.version, exc)  # fmt: skip
            return
        if stored is not None:
            self._apply_stored(stored)

    def _set_up(self, up: bool, why: BaseException | None = None) -> None:
        if up != self.store_up:
            if up:
                _log.info("policy store reachable")
            else:
                _log.warning("policy store unreachable: %s", why)
        self.store_up = up
        self.metrics.policy_store_up.set(1.0 if up else 0.0)

    async def follow(self) -> None:
        """Run until cancelled: subscribe, resync, apply each change; reconnect with backoff."""
        assert self.store is not None
        backoff = 0.1
        while True:
            try:
                async with self.store.client.pubsub() as pubsub:
                    await pubsub.subscribe(self.store.channel)
                    await self.resync()  # after subscribing: no change can fall between the two
                    self._set_up(True)
                    backoff = 0.1
                    next_read = time.monotonic() + self.refresh_s
                    while True:
                        wait = max(next_read - time.monotonic(), 0.0)
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                        if message is not None or time.monotonic() >= next_read:
                            await self.resync()
                            next_read = time.monotonic() + self.refresh_s
            except STORE_ERRORS as exc:
                self._set_up(False, exc)
                _log.debug("policy store: %s; retrying in %.1f s", exc, backoff)
            except Exception as exc:  # anything else must not end the following for good
                self._set_up(False, exc)
                _log.exception("following the policy store failed; retrying in %.1f s", backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
