"""Means learned online per group of requests, in bounded memory.

Each group keeps the mean of what was observed for it: a plain mean while few observations are
known, then a smoothed one that follows drift. A group is whatever the caller keys it by, and
callers key by what clients send (`x-request-class`): once `max_groups` are known a new group is
not learned, so a client inventing a class per request cannot grow the gateway's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")


def running_mean(old: float | None, value: float, n: int, smoothing: float) -> float:
    """The mean after the `n`-th observation `value`: plain at first, then smoothed at `smoothing`."""
    return value if old is None else old + max(1.0 / n, smoothing) * (value - old)


@dataclass
class GroupMeans(Generic[K]):
    smoothing: float
    max_groups: int
    means: dict[K, float] = field(default_factory=dict)
    counts: dict[K, int] = field(default_factory=dict)

    def observe(self, key: K, value: float) -> None:
        if key not in self.counts and len(self.counts) >= self.max_groups:
            return
        n = self.counts[key] = self.counts.get(key, 0) + 1
        self.means[key] = running_mean(self.means.get(key), value, n, self.smoothing)
