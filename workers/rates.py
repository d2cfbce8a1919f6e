"""Prompts sent to a replica, and their tokens, as rates a second: decaying counts read over the
time the prompts have been coming.

A count that decays with a time constant τ, divided by τ, is the rate only once the prompts have
come for several τ: counted from nothing, 5 s into a steady stream it reads 0.4 of it (τ = 10 s).
A gateway that has just started, or a replica whose prompts have just begun, would read its load
at that fraction, price every batch light, and learn the answers' slowness as slow decoding. So a
count is divided by the time its prompts have been seen, decayed the same way, τ(1 - e^{-T/τ});
the first prompt marks when they began and is not itself counted (the time seen starts at it).
After several τ this is the plain decaying rate again. A silence after the prompts began is seen,
and counted as one: what a storm after a quiet minute is, the burst windows tell (`pools.py`).

The counts of several processes and gateways are summed as rates and written back as one count
that reads, over the longest time seen of theirs, as their sum (`as_counts`; the summing is
`shared.py`'s): exact when written, and near it for the fraction of a second until the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _seen(seen_s: float, window_s: float) -> float:
    """The time seen, `seen_s`, as the decaying count weighs it: τ(1 - e^{-T/τ})."""
    return -window_s * math.expm1(-seen_s / window_s)


def per_s(prompts: float, tokens: float, at: float, seen_s: float, window_s: float, now: float) -> tuple[float, float]:
    """Prompts and prompt tokens a second at `now`, from counts last added to `at`, when their
    prompts had been seen for `seen_s`."""
    since = max(now - at, 0.0)
    weight = _seen(seen_s + since, window_s)
    if weight <= 0.0:
        return 0.0, 0.0  # (the first prompt alone: nothing counted yet)
    keep = math.exp(-since / window_s) / weight
    return prompts * keep, tokens * keep


def as_counts(prompts_per_s: float, tokens_per_s: float, seen_s: float, window_s: float) -> tuple[float, float]:
    """The counts that read as these rates, seen for `seen_s` (`per_s` at the moment they are written)."""
    weight = _seen(seen_s, window_s)
    return prompts_per_s * weight, tokens_per_s * weight


@dataclass
class PromptRate:
    """Prompts and their tokens sent to a replica: counts that decay with a time constant, read
    over the time they have been seen."""

    window_s: float
    prompts: float = 0.0
    """Prompts since the first, each decayed since it was added, to `at`."""
    tokens: float = 0.0
    at: float = 0.0
    """When the counts were last added to."""
    seen_s: float = 0.0
    """How long the prompts had been coming at `at` (since the first)."""
    began: bool = False

    def add(self, tokens: int, now: float) -> None:
        if not self.began:
            self.began, self.at = True, now  # the first marks the start
            return
        since = max(now - self.at, 0.0)
        decay = math.exp(-since / self.window_s)
        self.prompts = self.prompts * decay + 1.0
        self.tokens = self.tokens * decay + tokens
        self.at, self.seen_s = self.at + since, self.seen_s + since

    def per_s(self, now: float) -> tuple[float, float]:
        """Prompts and prompt tokens a second."""
        return per_s(self.prompts, self.tokens, self.at, self.seen_s, self.window_s, now)

    def words(self) -> tuple[float, float, float, float]:
        """What a process publishes of it (`shared.py`): the counts, when last added to, the time seen."""
        return self.prompts, self.tokens, self.at, self.seen_s
