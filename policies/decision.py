"""A routing decision, and the interface every policy implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec

from specgate.policies.features import RequestFeatures
from specgate.validation import Priority, Seconds
from specgate.workers.latency_fit import Priced
from specgate.workers.snapshot import ReplicaState, Snapshot


@dataclass(frozen=True)
class Decision:
    replica: ReplicaState
    reason: str
    """Short and machine-readable: what made the policy choose this replica."""
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    chance: float | None = None
    """The predicted probability that the request meets its SLOs there (policies that predict)."""
    best_effort: bool = False
    """Its SLOs are out of reach: it is served as well as can be, after every request that can
    still meet its own (the admission queue holds it back while such requests wait)."""
    terms: Priced | None = None
    """The predicted TTFT and TPOT as the profile prices them, term by term: what the measured
    answer re-fits the pool's step costs with."""

    @property
    def predicted_s(self) -> tuple[float | None, float | None]:
        """The predicted TTFT and TPOT in seconds, as observations are recorded."""
        ttft, tpot = self.predicted_ttft_ms, self.predicted_tpot_ms
        return (ttft / 1e3 if ttft is not None else None, tpot / 1e3 if tpot is not None else None)


@dataclass(frozen=True)
class Shed:
    """Refuse the request now: with `retry_after_s`, it cannot meet its SLOs now (HTTP 429 and
    Retry-After); without, no replica could meet them even idle (HTTP 400: a retry cannot help)."""

    reason: str
    retry_after_s: float | None
    detail: str = ""
    """What made the policy refuse, for the error message."""


@dataclass(frozen=True)
class Hold:
    """Keep the request in the gateway's admission queue: no replica can meet its SLOs now, but
    one may soon. Whoever holds it asks the policy again, with the time it has waited."""

    reason: str = "queued"


class Shedding(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When a policy may shed (refuse) a request it cannot serve in time: the policy document's
    `shedding`, the one name of this knob everywhere."""

    enabled: bool = False
    below_priority: Priority = 0
    """Requests whose x-priority is below this may be refused with 429."""
    retry_after_s: Seconds = 1.0


Verdict = Decision | Shed | Hold | None
"""What a policy says about a request."""


class Policy(Protocol):
    """A pure function of the request, the fleet snapshot and the policy's own parameters."""

    @property
    def name(self) -> str: ...

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Verdict:
        """The replica to use, a refusal, a hold, or None when no healthy replica can take the request."""
        ...


def spread(sequence: int) -> float:
    """The n-th point of a low-discrepancy sequence in [0, 1): any share of requests picked by it
    is exact and evenly spread over time, with no state and no randomness."""
    return (sequence * 0.6180339887498949) % 1.0


def least_loaded(replicas: tuple[ReplicaState, ...]) -> ReplicaState | None:
    """Fewest requests in flight from this gateway, then the lightest scraped load, then by name;
    each count divided by the replica's pool weight."""
    if not replicas:
        return None
    return min(replicas, key=lambda r: (r.in_flight / r.weight, r.load / r.weight, r.name))
