"""The fixed rules a user would otherwise run, as policies.

Every policy keeps serving when its preferred pool has no healthy replica: it falls back to the
other pool and says so in its reason, because a request refused is worse than a request served
by the other mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from specgate.calibration.modes import Pool
from specgate.policies.decision import Decision, least_loaded, spread
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.workers.snapshot import ReplicaState, Snapshot


def _decide(model: LatencyModel, features: RequestFeatures, replica: ReplicaState, reason: str) -> Decision:
    p = model.predict(replica, features)
    return Decision(replica, reason, p.ttft_ms, p.tpot_ms)


def _in_pool_or_fallback(
    model: LatencyModel, features: RequestFeatures, snapshot: Snapshot, pool: Pool, reason: str
) -> Decision | None:
    replica = least_loaded(snapshot.healthy(pool))
    if replica is not None:
        return _decide(model, features, replica, reason)
    replica = least_loaded(snapshot.healthy(pool.other))
    if replica is None:
        return None
    return _decide(model, features, replica, f"{pool.value}-pool-down")


@dataclass(frozen=True)
class RoundRobin:
    model: LatencyModel
    name: str = "round-robin"

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | None:
        healthy = sorted(snapshot.healthy(), key=lambda r: r.name)
        if not healthy:
            return None
        if len({r.weight for r in healthy}) == 1:
            return _decide(self.model, features, healthy[features.sequence % len(healthy)], "round-robin")
        # Weighted: each replica owns a slice of the wheel as wide as its weight, and the requests
        # land on it at evenly spread points.
        point = spread(features.sequence) * sum(r.weight for r in healthy)
        for replica in healthy:
            point -= replica.weight
            if point < 0:
                break
        return _decide(self.model, features, replica, "round-robin")


@dataclass(frozen=True)
class LeastLoaded:
    model: LatencyModel
    name: str = "least-loaded"

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | None:
        replica = least_loaded(snapshot.healthy())
        return None if replica is None else _decide(self.model, features, replica, "least-loaded")


@dataclass(frozen=True)
class PoolOnly:
    model: LatencyModel
    pool: Pool

    @property
    def name(self) -> str:
        return f"{self.pool.value}-only"

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | None:
        return _in_pool_or_fallback(self.model, features, snapshot, self.pool, f"{self.pool.value}-only")


@dataclass(frozen=True)
class Threshold:
    """Speculate while the speculative pool's mean load per healthy replica is under `max_load`.

    What vLLM's removed `speculative_disable_by_batch_size` did inside one engine, done across
    the fleet: above the threshold, new requests go to the plain pool.
    """

    model: LatencyModel
    max_load: float
    name: str = "threshold"

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | None:
        spec = snapshot.healthy(Pool.SPECULATIVE)
        if spec and sum(r.load / r.weight for r in spec) / len(spec) < self.max_load:
            return _in_pool_or_fallback(self.model, features, snapshot, Pool.SPECULATIVE, "below-threshold")
        return _in_pool_or_fallback(self.model, features, snapshot, Pool.PLAIN, "above-threshold")


@dataclass(frozen=True)
class Forced:
    """The pool the client asked for (`x-route-pool`), least loaded within it."""

    model: LatencyModel
    name: str = "forced"

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | None:
        if features.forced_pool is None:
            return None
        return _in_pool_or_fallback(self.model, features, snapshot, features.forced_pool, "forced")
