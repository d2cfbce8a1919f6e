"""What speculation gives each request, learned online: acceptance per request, not per pool.

A speculative replica's tokens per step, read from its counters, is the mean over every request it
drafted for; one request's own can be far from it. An n-gram proposer accepts much of a prompt that
repeats itself and little of free text; a draft model, EAGLE or MTP head accepts more of some
kinds of request than of others. So requests are grouped by model, endpoint, request class and
how much their prompt repeats itself (`protocol/repetition.py`), and for each group the gateway
learns, from the TPOT it measures on speculative replicas, how much faster or slower the group
decodes than the pool's mean predicts: its speedup, the factor on the tokens per step the latency
model uses for it.

Each observation is the log of the TPOT predicted at the pool's mean acceptance over the TPOT
measured; a group's speedup is its smoothed mean of those less the mean over all groups, so what
every request shares (a profile that is off, stalls, a slow replica) cancels out and only the
group's own difference remains.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from specgate.policies.means import GroupMeans, running_mean

REPETITION_EDGES = (0.05, 0.2, 0.45)
"""Bands of prompt repetition: free text, a little, much, mostly repeated."""
SMOOTHING = 0.1
MIN_OBSERVATIONS = 3
"""A group's speedup is used once it has this many observations; before, the pool's mean."""
MAX_SPEEDUP = 4.0
MAX_GROUPS = 4096
"""As for output lengths: a client inventing classes must not grow the gateway's memory."""

Group = tuple[str, str, str, int]


def group(model: str, endpoint: str, request_class: str, repetition: float) -> Group:
    return (model, endpoint, request_class, bisect.bisect_right(REPETITION_EDGES, repetition))


@dataclass
class DraftStats:
    """Mutable, owned by whoever routes; read by `speedup`."""

    groups: GroupMeans[Group] = field(default_factory=lambda: GroupMeans(SMOOTHING, MAX_GROUPS))
    overall: float | None = None
    """The smoothed mean over every group: what a request at the pool's mean acceptance gets."""
    observed: int = 0

    def observe(self, key: Group, predicted_tpot_s: float, speedup_used: float, observed_tpot_s: float) -> None:
        """A request of group `key` decoded on a speculative replica at `observed_tpot_s`, where
        `predicted_tpot_s` was predicted for it at a speedup of `speedup_used`."""
        if predicted_tpot_s <= 0 or observed_tpot_s <= 0 or speedup_used <= 0:
            return
        # The TPOT it would have been predicted at the pool's mean acceptance, over what it was.
        gain = math.log(predicted_tpot_s * speedup_used / observed_tpot_s)
        self.observed += 1
        self.overall = running_mean(self.overall, gain, self.observed, SMOOTHING)
        self.groups.observe(key, gain)

    def speedup(self, key: Group) -> float:
        """The factor on the pool's tokens per step for a request of group `key`: 1 until known."""
        mean = self.groups.means.get(key)
        if mean is None or self.overall is None or self.groups.counts.get(key, 0) < MIN_OBSERVATIONS:
            return 1.0
        return min(max(math.exp(mean - self.overall), 1.0 / MAX_SPEEDUP), MAX_SPEEDUP)
