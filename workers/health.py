"""Whether a replica takes requests: outlier ejection as the peers do it.

A replica is admitted on its first good scrape (its `/metrics` and `/health` both answer). It is
ejected when a request cannot connect to it, or after `eject_after` consecutive failures on its
own socket (5xx, no first byte in time, a stream that breaks, scrapes that fail), or when at least
`eject_failure_share` of its last requests failed (one that fails only some kinds of request never
fails three in a row, but fails its share: Envoy's failure-percentage ejection), or when it has
requests but makes no progress for `hang_after_s`. An ejected replica stays out for a base
ejection time that doubles on each repeat (up to a maximum) whatever its scrapes say, then is
probed: one request at a time until one succeeds. A failure while probing ejects it again. After
a clean stretch as long as the longest ejection, its record is forgotten. A client that leaves
is never the replica's failure: callers do not report it.
"""

from __future__ import annotations

import logging
from collections import deque
from enum import StrEnum

_log = logging.getLogger(__name__)


class State(StrEnum):
    UNKNOWN = "unknown"
    """Never seen up yet."""
    UP = "up"
    EJECTED = "ejected"
    PROBING = "probing"
    """Back after an ejection: one request at a time until one succeeds."""


class Health:
    def __init__(
        self,
        name: str,
        eject_after: int,
        base_ejection_s: float,
        max_ejection_s: float,
        *,
        failure_window: int = 20,
        eject_failure_share: float = 0.5,
    ) -> None:
        self.name = name
        self.eject_after = eject_after
        self.eject_failure_share = eject_failure_share
        self.outcomes: deque[bool] = deque(maxlen=failure_window)
        """Its last requests' outcomes on its own socket, True for a failure."""
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self.state = State.UNKNOWN
        self.ejected_until = 0.0
        self.ejections = 0
        """Ejections in the current record: each one lasts twice as long as the one before."""
        self.request_failures = 0
        self.scrape_failures = 0
        self.up_since = 0.0
        self.last_reason = ""

    @property
    def admitted(self) -> bool:
        return self.state in (State.UP, State.PROBING)

    def available(self, in_flight: int) -> bool:
        """Whether a policy may send it a request now."""
        return self.state is State.UP or (self.state is State.PROBING and in_flight == 0)

    def eject(self, now: float, reason: str) -> bool:
        """Take it out; False if it was out already."""
        if self.state is State.EJECTED:
            return False
        self.ejections += 1
        self.ejected_until = now + min(self.base_ejection_s * 2 ** (self.ejections - 1), self.max_ejection_s)
        self.state = State.EJECTED
        self.request_failures = self.scrape_failures = 0
        self.outcomes.clear()
        self.last_reason = reason
        _log.warning("ejecting replica %s for %.1f s: %s", self.name, self.ejected_until - now, reason)
        return True

    def request_failed(self, now: float, reason: str, *, at_once: bool = False) -> bool:
        """A failure on the replica's own socket; True when it ejected the replica."""
        self.request_failures += 1
        self.outcomes.append(True)
        if self.state is State.PROBING or at_once or self.request_failures >= self.eject_after:
            return self.eject(now, reason)
        window = self.outcomes
        if len(window) * 2 >= (window.maxlen or 0) and sum(window) >= self.eject_failure_share * len(window):
            return self.eject(now, f"{sum(window)} of its last {len(window)} requests failed ({reason})")
        return False

    def request_succeeded(self, now: float) -> None:
        self.request_failures = 0
        self.outcomes.append(False)
        if self.state is State.PROBING:
            _log.info("replica %s is back", self.name)
            self.state, self.up_since = State.UP, now

    def scrape_failed(self, now: float, reason: str) -> bool:
        self.scrape_failures += 1
        if self.scrape_failures >= self.eject_after and self.admitted:
            return self.eject(now, reason)
        return False

    def scrape_succeeded(self, now: float) -> None:
        self.scrape_failures = 0
        if self.state is State.UNKNOWN:
            _log.info("replica %s is up", self.name)
            self.state, self.up_since = State.UP, now
        elif self.state is State.EJECTED and now >= self.ejected_until:
            _log.info("probing replica %s", self.name)
            self.state = State.PROBING
        elif self.state is State.UP and self.ejections and now - self.up_since >= self.max_ejection_s:
            self.ejections = 0  # a clean stretch: the next ejection starts short again
