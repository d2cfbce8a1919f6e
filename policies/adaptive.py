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

from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from msgspec import Meta

from specgate.policies.decision import Decision, Shed, Shedding, spread
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel, Prediction
from specgate.validation import Fraction
from specgate.workers.snapshot import ReplicaState, Snapshot


class AdaptiveParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The adaptive policy's tuning: the policy document's `params` when its policy is adaptive."""

    harm_weight: Annotated[float, Meta(ge=0, le=100)] = 0.5
    """How much the delay imposed on requests already running counts against a replica."""
    slo_margin: Annotated[float, Meta(ge=0.1, le=0.999)] = 0.9
    """TTFT predicted within this share of its target counts as met for sure; past the target, as
    missed; in between, the chance falls linearly (predictions are means, latencies spread)."""
    min_chance: Fraction = 0.5
    """Below this chance of meeting its SLOs everywhere, a request is served best-effort (or shed)."""
    tolerance: Fraction = 0.05
    """Replicas whose chance is within this of the best compete on completion and harm."""


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
    params: AdaptiveParams = field(default_factory=AdaptiveParams)
    shedding: Shedding = field(default_factory=Shedding)
    exploration: float = 0.02
    """Share of requests sent to the other pool's best feasible replica, to keep learning it."""
    name: str = "adaptive"

    def _explores(self, sequence: int) -> bool:
        return spread(sequence) < self.exploration

    def chance(self, prediction: Prediction, features: RequestFeatures) -> float:
        chance = 1.0
        if features.slo_ttft_ms is not None:
            ratio = prediction.ttft_ms / features.slo_ttft_ms
            if ratio > 1.0:
                return 0.0
            margin = self.params.slo_margin
            if ratio > margin:
                chance = (1.0 - ratio) / (1.0 - margin)
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
            score = (p.completion_ms(output) + self.params.harm_weight * p.harm_ms) / replica.weight
            options.append(_Option(replica, p, self.chance(p, features), score))
        has_slo = features.slo_ttft_ms is not None or features.slo_tpot_ms is not None
        top = max(o.chance for o in options)
        if not has_slo:
            best, reason = min(options, key=lambda o: o.score), "fastest"
        elif top >= self.params.min_chance:
            contenders = [o for o in options if o.chance >= top - self.params.tolerance]
            best, reason = min(contenders, key=lambda o: o.score), "meets-slo"
            if self._explores(features.sequence):
                others = [o for o in contenders if o.replica.pool is not best.replica.pool]
                if others:
                    best, reason = min(others, key=lambda o: o.score), "explore"
        else:
            if self.shedding.enabled and features.priority < self.shedding.below_priority:
                return Shed("slo-unattainable", self.shedding.retry_after_s)
            # Past saving it, place the request where it costs the others' SLOs least: its harm,
            # weighted by the chance a request has there (the measure at hand of how much the
            # requests already there still stand to meet: where that is nil, they are late
            # already and lose nothing more), then the least-violating.
            best, reason = min(options, key=lambda o: (o.chance * o.prediction.harm_ms, o.score)), "best-effort"
        return Decision(best.replica, reason, best.prediction.ttft_ms, best.prediction.tpot_ms)
