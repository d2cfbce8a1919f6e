"""The adaptive policy: per request, the pool and replica most likely to meet its SLOs.

For every healthy replica the latency model predicts this request's TTFT, TPOT and the harm its
joining does to the requests already there. Replicas predicted to meet both SLOs are kept; among
them the one with the best predicted completion (plus the weighted harm) wins. When none can meet
them, the least-violating replica serves the request, unless shedding is on and the request's
priority is below the shedding line: then it is refused with a hint of when to retry. A small,
deterministic share of requests goes to the best feasible replica of the other pool, so the
corrections of the pool that is chosen less keep learning.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.decision import Decision, Shed
from policies.features import RequestFeatures
from policies.latency_model import LatencyModel, Prediction
from workers.snapshot import ReplicaState, Snapshot

_GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class _Option:
    replica: ReplicaState
    prediction: Prediction
    violation: float
    """The worse of predicted/target over the request's SLOs: at most 1 means both are met."""
    score: float


def violation(prediction: Prediction, features: RequestFeatures) -> float:
    worst = 0.0
    if features.slo_ttft_ms is not None:
        worst = max(worst, prediction.ttft_ms / features.slo_ttft_ms)
    if features.slo_tpot_ms is not None:
        worst = max(worst, max(prediction.tpot_ms, prediction.tpot_tail_ms) / features.slo_tpot_ms)
    return worst


@dataclass(frozen=True)
class Adaptive:
    model: LatencyModel
    exploration: float = 0.02
    """Share of requests sent to the other pool's best feasible replica, to keep learning it."""
    harm_weight: float = 0.5
    """How much the delay imposed on requests already running counts against a replica."""
    shed: bool = False
    shed_below_priority: int = 0
    """With shedding on, requests whose x-priority is below this may be refused."""
    retry_after_s: float = 1.0
    slo_margin: float = 0.9
    """A replica counts as meeting an SLO when predicted at most this share of it: predictions are
    means, and a request's own latency spreads around them."""
    name: str = "adaptive"

    def _explores(self, sequence: int) -> bool:
        # A low-discrepancy sequence: exactly the configured share, evenly spread, no randomness.
        return (sequence * _GOLDEN) % 1.0 < self.exploration

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | Shed | None:
        healthy = snapshot.healthy()
        if not healthy:
            return None
        output = self.model.expected_output(features)
        options = []
        for replica in healthy:
            p = self.model.predict(replica, features)
            score = p.completion_ms(output) + self.harm_weight * p.harm_ms
            options.append(_Option(replica, p, violation(p, features), score))
        has_slo = features.slo_ttft_ms is not None or features.slo_tpot_ms is not None
        feasible = [o for o in options if o.violation <= self.slo_margin]
        if feasible:
            best = min(feasible, key=lambda o: o.score)
            reason = "meets-slo" if has_slo else "fastest"
            if self._explores(features.sequence):
                others = [o for o in feasible if o.replica.pool is not best.replica.pool]
                if others:
                    best, reason = min(others, key=lambda o: o.score), "explore"
        else:
            if self.shed and features.priority < self.shed_below_priority:
                return Shed("slo-unattainable", self.retry_after_s)
            # Past saving it, place the request where it costs the others least.
            best = min(options, key=lambda o: o.score)
            reason = "best-effort"
        return Decision(best.replica, reason, best.prediction.ttft_ms, best.prediction.tpot_ms)
