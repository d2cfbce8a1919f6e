"""The tokens each pool generated over the last minute, as this gateway relayed them: the
throughput that prices a pool's tokens (`calibration/pricing.py`).

Counted in one-second buckets per pool, so adding a request's tokens and reading a rate cost the
same whatever the traffic; a rate is over the window, or over the time since the gateway started
when that is shorter (a gateway a few seconds old does not divide by a minute it has not seen).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

WINDOW_S = 60.0


class TokenRate:
    def __init__(self, started: float, window_s: float = WINDOW_S) -> None:
        if window_s < 1:
            raise ValueError("the window must be at least a second")
        self.started = started
        self.window_s = window_s
        self._buckets: dict[Hashable, deque[list[float]]] = {}
        """Per key, [second, tokens] buckets, oldest first."""

    def add(self, key: Hashable, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        buckets = self._buckets.setdefault(key, deque())
        second = float(int(now))
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += tokens
        else:
            buckets.append([second, float(tokens)])
        self._expire(buckets, now)

    def per_second(self, key: Hashable, now: float) -> float:
        """Tokens a second over the window ending `now`."""
        buckets = self._buckets.get(key)
        if not buckets:
            return 0.0
        self._expire(buckets, now)
        span = min(self.window_s, max(now - self.started, 1.0))
        return sum(tokens for _, tokens in buckets) / span

    def _expire(self, buckets: deque[list[float]], now: float) -> None:
        while buckets and buckets[0][0] <= now - self.window_s:
            buckets.popleft()
