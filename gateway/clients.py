"""Who may call the gateway: client keys, each with its rights and limits.

Off by default (a local run needs no keys); on, every request must carry a known key as
`Authorization: Bearer <key>` (or `api-key` / `x-api-key`), else 401. Keys are kept hashed
(SHA-256): the gateway never stores or logs one. Each key may have a rate limit (a token bucket:
`rate_per_s`, `burst`) and a concurrency limit, both answered with 429 and `Retry-After`, and
rights: to force a pool with `x-route-pool`, and the highest `x-priority` it may claim (403
past them). Keys come from a file, from the environment, and from Redis (`{prefix}:clients`, a
hash of name to entry, re-read with the policy), merged by name.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from multidict import CIMultiDictProxy

from specgate.gateway.errors import Forbidden, Overloaded, Unauthorized
from specgate.validation import NonEmpty, Priority, convert

Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class ClientKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One client's key (hashed) and what it may do."""

    name: NonEmpty
    sha256: Sha256
    """SHA-256 of the key, in hex: `specgate keys hash KEY` prints it."""
    rate_per_s: Annotated[float, Meta(gt=0)] | None = None
    """Requests per second on average; none: unlimited."""
    burst: Annotated[int, Meta(ge=1)] | None = None
    """Requests at once above the rate (default: one second's worth)."""
    max_concurrency: Annotated[int, Meta(ge=1)] | None = None
    may_force_pool: bool = False
    """Whether `x-route-pool` is honoured for this client."""
    max_priority: Priority = 0
    """The highest `x-priority` it may send."""


def hashed(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def parse_keys(entries: Any, where: str) -> dict[str, ClientKey]:
    """Key entries (a list of tables) by their hash; `Invalid` names the entry at fault."""
    keys = convert(entries, list[ClientKey], root=where, prefix=where)
    return {k.sha256: k for k in keys}


@dataclass
class _Client:
    key: ClientKey
    tokens: float
    refilled: float
    in_flight: int = 0


@dataclass
class Clients:
    """The known keys and the state of their limits."""

    keys: Mapping[str, ClientKey] = field(default_factory=dict)
    _state: dict[str, _Client] = field(default_factory=dict)

    def replace_keys(self, keys: Mapping[str, ClientKey]) -> None:
        """New key set: limits carry over for the keys that stay."""
        self.keys = dict(keys)
        self._state = {h: s for h, s in self._state.items() if h in self.keys}

    def identify(self, headers: CIMultiDictProxy[str]) -> ClientKey:
        """The caller's key entry; Unauthorized without a known one."""
        given = _presented(headers)
        digest = hashed(given) if given else ""
        # A dictionary lookup by the hash leaks nothing about the key (it is a hash already);
        # compare in constant time anyway, as the admin token is.
        entry = self.keys.get(digest)
        if entry is None or not hmac.compare_digest(entry.sha256, digest):
            raise Unauthorized("a valid API key is required: Authorization: Bearer <key>")
        return entry

    def admit(self, key: ClientKey, now: float | None = None) -> None:
        """Count a request against the key's limits; Overloaded (429) past them."""
        now = time.monotonic() if now is None else now
        state = self._state.get(key.sha256)
        burst = float(key.burst or max(key.rate_per_s or 1.0, 1.0))
        if state is None or state.key is not key:
            state = self._state[key.sha256] = _Client(key, burst, now)
        if key.rate_per_s is not None:
            state.tokens = min(burst, state.tokens + (now - state.refilled) * key.rate_per_s)
            state.refilled = now
            if state.tokens < 1.0:
                wait = (1.0 - state.tokens) / key.rate_per_s
                raise Overloaded(f"rate limit of {key.rate_per_s:g} requests/s exceeded", retry_after_s=wait,
                                 reason="rate-limited")  # fmt: skip
        if key.max_concurrency is not None and state.in_flight >= key.max_concurrency:
            raise Overloaded(
                f"at most {key.max_concurrency} requests at once", retry_after_s=1.0, reason="concurrency-limited"
            )
        if key.rate_per_s is not None:
            state.tokens -= 1.0
        state.in_flight += 1

    def release(self, key: ClientKey) -> None:
        state = self._state.get(key.sha256)
        if state is not None:
            state.in_flight -= 1


def check_rights(key: ClientKey, forced_pool: object, priority: int) -> None:
    """Forbidden (403) when the request claims what its key may not."""
    if forced_pool is not None and not key.may_force_pool:
        raise Forbidden("this API key may not choose a pool", param="x-route-pool")
    if priority > key.max_priority:
        raise Forbidden(f"this API key may send x-priority up to {key.max_priority}", param="x-priority")


def _presented(headers: CIMultiDictProxy[str]) -> str:
    scheme, _, credential = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    return (headers.get("api-key") or headers.get("x-api-key") or "").strip()


def merged(*key_sets: Mapping[str, ClientKey]) -> dict[str, ClientKey]:
    """Key sets merged by client name, a later set winning."""
    by_name = {entry.name: entry for keys in key_sets for entry in keys.values()}
    return {e.sha256: e for e in by_name.values()}
