"""The adaptive policy: per request, the pool and replica most likely to meet its SLOs.

For every healthy replica the latency model predicts this request's TTFT, TPOT and the harm its
joining does to the requests already there. What a replica is worth is the request's chance of
meeting both SLOs there, less the SLOs of the requests already there that its joining is expected
to cost (a replica at the edge of its TPOT target gains nothing by taking one more request that
pushes two others past it). Replicas worth an even chance are kept; among them the one with the
best predicted completion (plus the weighted harm) wins. When none is, the request is refused with
a hint of when to retry if shedding is on and its priority is below the shedding line (and refused
outright when no replica could meet its SLOs even idle, once the predictions that say so have been
seen measured often enough to be trusted); otherwise it waits in the gateway's admission queue
while a replica may soon offer more: while one of the requests on a replica may end before its
TTFT target passes, or while other requests held in the gateway wait for the room it would take
(else the best it is offered now is all it will be offered in time, and it goes there). Past
saving, it is served best-effort only where it would meet its TPOT target without costing the
requests already there theirs (with the admission queue off, where it costs their SLOs least: on
a replica whose requests are already late, else on the least-violating one). Under overload this
keeps the replicas that still meet their SLOs meeting them, rather than spreading the overload
until every replica misses. A small, deterministic share of requests goes to the best feasible
replica of the other pool, so the fitted step costs of the pool that is chosen less keep learning.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated

import msgspec
from msgspec import Meta

from specgate.calibration.modes import Pool
from specgate.policies.admission import Admission
from specgate.policies.decision import Decision, Hold, Shed, Shedding, Verdict, spread
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel, Prediction
from specgate.validation import Fraction
from specgate.workers.snapshot import ReplicaState, Scales, Snapshot


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
    min_checked: Annotated[int, Meta(ge=0, le=100_000)] = 20
    """Predictions a pool must have seen measured before they may refuse a request as out of reach."""
    crowding_weight: Annotated[float, Meta(ge=0, le=100)] = 1.0
    """How much the SLOs a request's joining is expected to cost the requests already on a replica
    count against its own chance there (0: not at all)."""


@dataclass(frozen=True)
class _Option:
    replica: ReplicaState
    prediction: Prediction
    chance: float
    """Predicted probability that the request meets both of its SLOs on this replica."""
    score: float
    worth: float
    """Its chance, less the weighted SLOs its joining is expected to cost the requests already there."""


@dataclass(frozen=True)
class Adaptive:
    model: LatencyModel
    params: AdaptiveParams = field(default_factory=AdaptiveParams)
    shedding: Shedding = field(default_factory=Shedding)
    exploration: float = 0.02
    """Share of requests sent to the other pool's best feasible replica, to keep learning it."""
    admission: Admission = field(default_factory=Admission)
    name: str = "adaptive"

    def _explores(self, sequence: int) -> bool:
        return spread(sequence) < self.exploration

    def chance(self, prediction: Prediction, ttft_ms: float | None, tpot_ms: float | None) -> float:
        """The chance a request predicted so meets a TTFT target of `ttft_ms` and a TPOT one of `tpot_ms`."""
        ttft, tpot = self._chances(prediction, ttft_ms, tpot_ms)
        return ttft * tpot

    def _chances(self, prediction: Prediction, ttft_ms: float | None, tpot_ms: float | None) -> tuple[float, float]:
        """The chances of meeting each target apart (the TPOT one not worked out, 1, where the TTFT
        one is nil)."""
        ttft = 1.0
        if ttft_ms is not None:
            ratio = prediction.ttft_ms / ttft_ms if ttft_ms > 0 else float("inf")
            margin = self.params.slo_margin
            ttft = 0.0 if ratio > 1.0 else (1.0 - ratio) / (1.0 - margin) if ratio > margin else 1.0
        if not ttft or tpot_ms is None:
            return ttft, 1.0
        return ttft, self.model.tpot_met_probability(prediction, tpot_ms)

    def _options(self, snapshot: Snapshot, features: RequestFeatures, ttft_ms: float | None) -> list[_Option]:
        """Every healthy replica as an option, for a TTFT target of `ttft_ms`."""
        output = self.model.expected_output(features)
        options = []
        tpot_ms = features.slo_tpot_ms
        for replica in snapshot.healthy():
            p = self.model.predict(replica, features)
            score = (p.completion_ms(output) + self.params.harm_weight * p.harm_ms) / replica.weight
            ttft_chance, tpot_chance = self._chances(p, ttft_ms, tpot_ms)
            chance = worth = ttft_chance * tpot_chance
            # (Sure to meet, it costs the others nothing; out of reach, it is not placed for its worth.)
            if 0.0 < chance < 1.0 and tpot_ms is not None and self.params.crowding_weight:
                worth -= self.params.crowding_weight * self.model.crowding_loss(p, tpot_ms, tpot_chance)
            options.append(_Option(replica, p, chance, score, worth))
        return options

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Verdict:
        if not snapshot.healthy():
            return None
        remaining = features.remaining_ttft_ms
        options = self._options(snapshot, features, remaining)
        if features.slo_ttft_ms is None and features.slo_tpot_ms is None:
            best = min(options, key=lambda o: o.score)
            return self._decision(best, "fastest")
        top = max(o.worth for o in options)
        if top >= self.params.min_chance:
            contenders = [o for o in options if o.worth >= top - self.params.tolerance]
            best, reason = min(contenders, key=lambda o: o.score), "meets-slo"
            if self._explores(features.sequence):
                others = [o for o in contenders if o.replica.pool is not best.replica.pool]
                if others:
                    best, reason = min(others, key=lambda o: o.score), "explore"
            return self._decision(best, reason)
        if self.shedding.enabled and features.priority < self.shedding.below_priority:
            return Shed("slo-unattainable", self.shedding.retry_after_s, "no replica can meet its SLOs now")
        admission = self.admission
        if not admission.enabled:
            return self._best_effort(options)
        # What could an idle replica offer, with what is left of the TTFT target?
        # (A pool's replicas share its fitted step costs: idle, they offer the same.)
        idle = {o.replica.pool: o.replica for o in options}
        at_idle = {pool: self.model.predict(r.idle(), features) for pool, r in idle.items()}
        reachable = max(self.chance(p, remaining, features.slo_tpot_ms) for p in at_idle.values())
        if reachable > 0:
            # Waiting pays only while a replica could offer more than the best one offers now:
            # when even an idle one offers a long shot, the best long shot now is as good.
            best = max(options, key=lambda o: (o.worth, -o.score))
            enough = min(self.params.min_chance, reachable) * (1 - self.params.tolerance)
            # Nor while no replica will offer more before its target passes (`_may_offer`),
            # unless other requests held in the gateway (itself aside) wait for the room it
            # would take.
            contended = snapshot.held - (1 if features.waited_ms else 0) >= 1
            if best.worth > 0 and (
                best.worth >= enough or not (contended or self._may_offer(options, features, at_idle))
            ):
                return self._decision(best, "best-chance")
            return Hold("queued")  # one may soon: wait in the gateway, not in a replica's queue
        if not features.waited_ms and admission.refuse_infeasible:
            # A prediction not yet seen measured refuses only what no fitted scale could bring within
            # reach: a profile of other hardware can be off by half, and refusing on it would keep it
            # so. Otherwise an idle replica whose predictions rest on the least serves the request
            # best-effort, and its answer corrects them.
            hopeful = [o for o in options if self._could_correct(o.replica, features)]
            if not hopeful:
                return Shed("slo-infeasible", None, self._infeasible(features, idle.values()))
            least = min(hopeful, key=lambda o: (o.replica.checked, o.score))
            return self._decision(least, "unchecked", best_effort=True)
        # Its SLOs are lost: serve it best-effort, where it is sure to be served before the
        # wait runs out and would meet its TPOT target without costing the requests already there
        # theirs (its worth, not its chance: a lost request spends no one's room), else wait in the
        # gateway for such a place or for the end of the wait.
        left = admission.give_up_ms(features) - features.waited_ms
        relaxed = self._options(snapshot, features, left)
        best = max(relaxed, key=lambda o: (o.worth, -o.score))
        if best.worth >= self.params.min_chance:
            return self._decision(best, "best-effort", best_effort=True)
        return Hold("best-effort")

    def _may_offer(self, options: list[_Option], features: RequestFeatures, at_idle: dict[Pool, Prediction]) -> bool:
        """Whether a replica may offer the request more before its TTFT target passes: whether
        one of its requests is expected to finish in the time the target leaves beyond an idle
        replica's TTFT (`at_idle`, by pool; their remaining lives taken as spread evenly up to one
        whole answer like its own). A tight TTFT target leaves the fleet no time to change: what it offers now is
        all it will offer in time, and holding the request only runs out its target."""
        remaining = features.remaining_ttft_ms
        if remaining is None:
            return True
        output = self.model.expected_output(features)
        for option in options:
            replica, p = option.replica, option.prediction
            slack = remaining * self.params.slo_margin - at_idle[replica.pool].ttft_ms
            life = max(p.ttft_ms + p.tpot_ms * output, 1e-3)
            if slack > 0 and replica.load * slack / life >= 1.0:
                return True
        return False

    def _could_correct(self, replica: ReplicaState, features: RequestFeatures) -> bool:
        """Too few of the replica's pool's predictions seen measured to trust them, nothing of ours
        on it (one request at a time checks them, as a half-open circuit probes), and the request
        could meet its SLOs there idle, were the profile as far too slow as the fit can say."""
        if replica.checked >= self.params.min_checked or replica.in_flight:
            return False
        best = replace(replica.idle(), scales=Scales.lowest())
        return self.chance(self.model.predict(best, features), features.remaining_ttft_ms, features.slo_tpot_ms) > 0

    def _best_effort(self, options: list[_Option]) -> Decision:
        """Past saving it, a request goes where its chance is best, then where it costs the others'
        SLOs least: its harm weighted by the chance a request has there (the measure at hand of how
        much the requests already there still stand to meet: where that is nil, they are late
        already and lose nothing more), then the least-violating."""
        return self._decision(
            min(options, key=lambda o: (-o.chance, o.chance * o.prediction.harm_ms, o.score)), "best-effort", True
        )

    def _infeasible(self, features: RequestFeatures, replicas: object) -> str:
        targets = [
            f"{name} {value:g}"
            for name, value in (("x-slo-ttft-ms", features.slo_ttft_ms), ("x-slo-tpot-ms", features.slo_tpot_ms))
            if value is not None
        ]
        return f"no replica could meet {' and '.join(targets)} even idle (a {features.prompt_tokens}-token prompt)"

    @staticmethod
    def _decision(option: _Option, reason: str, best_effort: bool = False) -> Decision:
        p = option.prediction
        return Decision(option.replica, reason, p.ttft_ms, p.tpot_ms, option.chance, best_effort, p.terms)
