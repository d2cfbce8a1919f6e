"""The adaptive policy: per request, the pool and replica most likely to meet its SLOs.

For every healthy replica the latency model predicts this request's TTFT, TPOT and the harm its
joining does to the requests already there. Replicas predicted to meet both SLOs are kept; among
them the one with the best predicted completion (plus the weighted harm) wins. When none can meet
them, the request is refused with a hint of when to retry if shedding is on and its priority is
below the shedding line; otherwise it is served best-effort where it costs the other requests'
SLOs least: on a replica whose requests are already late, else on the least-violating one. Under
overload this keeps the replicas that still meet their SLOs meeting them, rather than spreading
the overload until every replica misses. A small,
deterministic share of requests goes to the best feasible replica of the other pool, so the
corrections of the pool that is chosen less keep learning.
"""

from __future__ import annotations

from dataclasses import dataclass

from specgate.policies.decision import Decision, Shed, spread
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel, Prediction
from specgate.workers.snapshot import ReplicaState, Snapshot


@dataclass(frozen=True)
class _Option:
    replica: ReplicaState
    prediction: Prediction
    chance: float
    """Predicted probability that the request meets both of its SLOs on this replica."""
    score: float


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
    """TTFT predicted within this share of its target counts as met for sure; past the target, as
    missed; in between, the chance falls linearly (predictions are means, latencies spread)."""
    min_chance: float = 0.5
    """Below this chance of meeting its SLOs everywhere, a request is served best-effort (or shed)."""
    tolerance: float = 0.05
    """Replicas whose chance is within this of the best compete on completion and harm."""
    name: str = "adaptive"

    def _explores(self, sequence: int) -> bool:
        return spread(sequence) < self.exploration

    def chance(self, prediction: Prediction, features: RequestFeatures) -> float:
        chance = 1.0
        if features.slo_ttft_ms is not None:
            ratio = prediction.ttft_ms / features.slo_ttft_ms
            if ratio > 1.0:
                return 0.0
            if ratio > self.slo_margin:
                chance = (1.0 - ratio) / (1.0 - self.slo_margin)
        if features.slo_tpot_ms is not None:
            chance *= self.model.tpot_met_probability(prediction, features.slo_tpot_ms)
        return chance

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | Shed | None:
        healthy = snapshot.healthy()
        if not healthy:
            return None
        output = self.model.expected_output(features)
        options = []
        for replica in healthy:
            p = self.model.predict(replica, features)
            score = (p.completion_ms(output) + self.harm_weight * p.harm_ms) / replica.weight
            options.append(_Option(replica, p, self.chance(p, features), score))
        has_slo = features.slo_ttft_ms is not None or features.slo_tpot_ms is not None
        top = max(o.chance for o in options)
        if not has_slo:
            best, reason = min(options, key=lambda o: o.score), "fastest"
        elif top >= self.min_chance:
            contenders = [o for o in options if o.chance >= top - self.tolerance]
            best, reason = min(contenders, key=lambda o: o.score), "meets-slo"
            if self._explores(features.sequence):
                others = [o for o in contenders if o.replica.pool is not best.replica.pool]
                if others:
                    best, reason = min(others, key=lambda o: o.score), "explore"
        else:
            if self.shed and features.priority < self.shed_below_priority:
                return Shed("slo-unattainable", self.retry_after_s)
            # Past saving it, place the request where it costs the others' SLOs least: its harm,
            # weighted by the chance a request has there (the measure at hand of how much the
            # requests already there still stand to meet: where that is nil, they are late
            # already and lose nothing more), then the least-violating.
            best, reason = min(options, key=lambda o: (o.chance * o.prediction.harm_ms, o.score)), "best-effort"
        return Decision(best.replica, reason, best.prediction.ttft_ms, best.prediction.tpot_ms)
