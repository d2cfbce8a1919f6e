"""The policy document in Redis: the current version, who changed it, when and why, and a history.

Keys, under a configurable prefix so that several deployments can share one Redis:

- `{prefix}:policy` — a hash: `version` (1, 2, ...), `document` (canonical JSON), `who`, `when`
  (Unix seconds), `why`;
- `{prefix}:policy:history` — a list of the same records as JSON, newest first, at most
  `history_limit` long;
- `{prefix}:policy:changed` — the pub/sub channel every write announces its version on;
- `{prefix}:clients` — a hash of client name to client key entry (JSON), when client keys are on.

A write is one Lua script, so it is atomic: it compares the version the writer last read with the
current one (compare-and-set: two operators cannot silently overwrite each other), bumps the
version, records the change and publishes it. Documents are validated before they are written
and again by every gateway before it applies one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from specgate.calibration.profiles import PROFILES, Profile
from specgate.policies.document import PolicyDocument, loads

HISTORY_LIMIT = 100

_WRITE = """
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= current then
  return {0, current}
end
local version = current + 1
redis.call('HSET', KEYS[1], 'version', version, 'document', ARGV[2], 'who', ARGV[3], 'when', ARGV[4], 'why', ARGV[5])
local record = cjson.encode({version = version, document = ARGV[2], who = ARGV[3], when = ARGV[4], why = ARGV[5]})
redis.call('LPUSH', KEYS[2], record)
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[6]) - 1)
redis.call('PUBLISH', KEYS[3], version)
return {1, version}
"""


_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class VersionConflict(Exception):
    """The document changed since the writer read it."""

    def __init__(self, expected: int, current: int) -> None:
        super().__init__(f"the policy is at version {current}, not {expected}: read it again and reapply the change")
        self.expected = expected
        self.current = current


@dataclass(frozen=True)
class StoredPolicy:
    version: int
    document: str
    """The document's canonical JSON, as stored."""
    who: str
    when: float
    why: str

    def parsed(self, profiles: Mapping[str, Profile] = PROFILES) -> PolicyDocument:
        return loads(self.document, profiles)

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "document": orjson.loads(self.document),
            "who": self.who,
            "when": self.when,
            "why": self.why,
        }


def _record(fields: dict[str, str]) -> StoredPolicy:
    return StoredPolicy(
        version=int(fields["version"]),
        document=fields["document"],
        who=fields.get("who", ""),
        when=float(fields.get("when") or 0.0),
        why=fields.get("why", ""),
    )


class PolicyStore:
    def __init__(self, client: aioredis.Redis, prefix: str = "specgate", history_limit: int = HISTORY_LIMIT) -> None:
        self.client = client
        self.key = f"{prefix}:policy"
        self.history_key = f"{prefix}:policy:history"
        self.channel = f"{prefix}:policy:changed"
        self.clients_key = f"{prefix}:clients"
        self.history_limit = history_limit
        self._write = client.register_script(_WRITE)
        self._unlock = client.register_script(_UNLOCK)

    @classmethod
    def connect(cls, url: str, prefix: str = "specgate", *, timeout_s: float = 2.0) -> PolicyStore:
        # A pooled connection outlives a Redis restart only as a dead socket: retry a command once
        # on a fresh one rather than fail it.
        client = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=1),
            retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        )
        return cls(client, prefix)

    async def close(self) -> None:
        await self.client.aclose()

    async def current(self) -> StoredPolicy | None:
        fields = await self.client.hgetall(self.key)
        return _record({str(k): str(v) for k, v in fields.items()}) if fields else None

    async def write(
        self, document: PolicyDocument, *, expected_version: int | None, who: str, why: str
    ) -> StoredPolicy:
        """Store a new version; `expected_version` None writes whatever the current version is."""
        text = document.dumps().decode()
        when = time.time()
        expected = "" if expected_version is None else str(expected_version)
        ok, version = await self._write(
            keys=[self.key, self.history_key, self.channel],
            args=[expected, text, who, f"{when:.6f}", why, self.history_limit],
        )
        if not ok:
            raise VersionConflict(expected_version if expected_version is not None else -1, int(version))
        return StoredPolicy(int(version), text, who, when, why)

    async def lock(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take `{prefix}:lock:{name}` for `ttl_s` unless another holder has it: one gateway of
        many does a thing at a time."""
        return bool(await self.client.set(f"{self.key}:lock:{name}", holder, nx=True, px=max(int(ttl_s * 1e3), 1)))

    async def unlock(self, name: str, holder: str) -> None:
        """Give the lock back, if `holder` still has it."""
        await self._unlock(keys=[f"{self.key}:lock:{name}"], args=[holder])

    async def client_keys(self) -> dict[str, object]:
        """The client key entries kept under `{prefix}:clients` (name -> JSON entry), decoded;
        an entry that is not JSON is left out."""
        raw = await self.client.hgetall(self.clients_key)
        out: dict[str, object] = {}
        for name, value in raw.items():
            try:
                out[str(name)] = orjson.loads(value)
            except orjson.JSONDecodeError:
                continue
        return out

    async def history(self, limit: int | None = None) -> list[StoredPolicy]:
        """Newest first."""
        raw = await self.client.lrange(self.history_key, 0, (limit or self.history_limit) - 1)
        return [_record({k: str(v) for k, v in orjson.loads(item).items()}) for item in raw]

    async def at(self, version: int) -> StoredPolicy | None:
        for record in await self.history():
            if record.version == version:
                return record
        return None

    async def rollback(self, version: int, *, who: str, why: str = "") -> StoredPolicy:
        """Make the document of an earlier version current again, as a new version."""
        old = await self.at(version)
        if old is None:
            raise KeyError(f"version {version} is not in the history (it keeps the last {self.history_limit})")
        current = await self.current()
        return await self.write(
            old.parsed(),
            expected_version=current.version if current else None,
            who=who,
            why=why or f"rollback to version {version}",
        )
