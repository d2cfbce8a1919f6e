"""Means learned online per group of requests, in bounded memory.

Each group keeps the mean of what was observed for it: a plain mean while few observations are
known (with the caller's prior, if it gives one, counted as `prior_weight` of them), then a
smoothed one that follows drift. A group is whatever the caller keys it by, and
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
    prior_weight: int = 0
    """How many observations a prior given to `observe` is worth."""
    means: dict[K, float] = field(default_factory=dict)
    counts: dict[K, int] = field(default_factory=dict)

    def learns(self, key: K) -> bool:
        """Whether `key` is learned: known, or there is room for a new group."""
        return key in self.counts or len(self.counts) < self.max_groups

    def observe(self, key: K, value: float, prior: float | None = None) -> None:
        """Learn `value` for `key`; `prior`, what the group was taken to be before it was observed."""
        if not self.learns(key):
            return
        n = self.counts[key] = self.counts.get(key, 0) + 1
        weight = self.prior_weight if prior is not None else 0
        self.means[key] = running_mean(self.means.get(key, prior), value, n + weight, self.smoothing)
