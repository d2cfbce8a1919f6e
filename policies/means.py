"""Means learned online per group of requests, in bounded memory.

Each group keeps the mean of what was observed for it: a plain mean while few observations are
known, then a smoothed one that follows drift, and how many observations that mean is worth. A
group is whatever the caller keys it by, and callers key by what clients send
(`x-request-class`): once `max_groups` are known a new group is not learned, so a client
inventing a class per request cannot grow the gateway's memory.
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

    def learns(self, key: K) -> bool:
        """Whether `key` is learned: known, or there is room for a new group."""
        return key in self.counts or len(self.counts) < self.max_groups

    def observe(self, key: K, value: float) -> None:
        """Learn `value` for `key`."""
        if not self.learns(key):
            return
        n = self.counts[key] = self.counts.get(key, 0) + 1
        self.means[key] = running_mean(self.means.get(key), value, n, self.smoothing)

    def worth(self, key: K) -> float:
        """How many observations the group's mean is worth: its count while the mean is plain, and
        at most what a smoothed mean is worth (its variance is the observations' over (2 - s) / s)."""
        return min(float(self.counts.get(key, 0)), (2.0 - self.smoothing) / self.smoothing)
