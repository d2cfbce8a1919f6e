"""Policies by name, each with the type of its parameters, and the routing plan that runs them.

A plan is immutable: the gateway swaps a new one in with one assignment, so a request is always
routed by exactly one complete plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from specgate.calibration.modes import Pool
from specgate.policies.adaptive import Adaptive, AdaptiveParams
from specgate.policies.admission import Admission
from specgate.policies.baselines import Forced, LeastLoaded, PoolOnly, RoundRobin, Threshold
from specgate.policies.decision import Policy, Shedding, Verdict
from specgate.policies.features import RequestFeatures, SloTargets
from specgate.policies.latency_model import LatencyModel
from specgate.validation import Invalid, convert
from specgate.workers.snapshot import Snapshot


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A policy without parameters."""


class ThresholdParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_load: Annotated[float, Meta(gt=0)] = 8.0
    """Mean requests per speculative replica above which new requests go to the plain pool."""


@dataclass(frozen=True)
class Knobs:
    """The policy document's settings a policy may read besides its own parameters."""

    shedding: Shedding = field(default_factory=Shedding)
    exploration: float = 0.02
    admission: Admission = field(default_factory=Admission)


@dataclass(frozen=True)
class PolicyKind:
    params: type[msgspec.Struct]
    build: Callable[[LatencyModel, Any, Knobs], Policy]
    sheds: bool = False
    """Whether the policy reads `shedding` (the others never refuse a request)."""


POLICIES: Mapping[str, PolicyKind] = {
    "adaptive": PolicyKind(
        AdaptiveParams, lambda m, p, k: Adaptive(m, p, k.shedding, k.exploration, k.admission), sheds=True
    ),
    "round-robin": PolicyKind(NoParams, lambda m, _p, _k: RoundRobin(m)),
    "least-loaded": PolicyKind(NoParams, lambda m, _p, _k: LeastLoaded(m)),
    "speculative-only": PolicyKind(NoParams, lambda m, _p, _k: PoolOnly(m, Pool.SPECULATIVE)),
    "plain-only": PolicyKind(NoParams, lambda m, _p, _k: PoolOnly(m, Pool.PLAIN)),
    "threshold": PolicyKind(ThresholdParams, lambda m, p, _k: Threshold(m, p.max_load)),
}

POLICY_NAMES = tuple(POLICIES)


def policy_kind(name: str) -> PolicyKind:
    try:
        return POLICIES[name]
    except KeyError:
        raise Invalid("policy", f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None


def policy_params(name: str, params: Mapping[str, Any]) -> msgspec.Struct:
    """`params` checked against the named policy's parameters (`Invalid` names `params.<key>`)."""
    params_type: Any = policy_kind(name).params
    result: msgspec.Struct = convert(dict(params), params_type, root="params", prefix="params")
    return result


def build_policy(
    name: str, params: Mapping[str, Any] | msgspec.Struct, model: LatencyModel, knobs: Knobs | None = None
) -> Policy:
    kind = policy_kind(name)
    checked = params if isinstance(params, kind.params) else policy_params(name, params)  # type: ignore[arg-type]
    return kind.build(model, checked, knobs or Knobs())


@dataclass(frozen=True)
class RoutingPlan:
    policy: Policy
    model: LatencyModel
    allow_pool_override: bool = True
    version: str = "0"
    slo: SloTargets = field(default_factory=SloTargets)
    slo_classes: Mapping[str, SloTargets] = field(default_factory=dict)
    """Per request class (`x-request-class`); a class not listed gets `slo`."""
    pool_weights: Mapping[Pool, float] = field(default_factory=dict)
    drained: frozenset[Pool] = frozenset()
    """Pools that take no new requests: an operator's kill switch."""
    admission: Admission = field(default_factory=Admission)
    """How requests the policy holds wait in the gateway."""

    def slo_for(self, request_class: str) -> SloTargets:
        return self.slo_classes.get(request_class, self.slo)

    @property
    def profile(self) -> str:
        """The profile the plan predicts with: the one the fleet's step-cost fits must follow."""
        return self.model.profile.name

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Verdict:
        if self.drained or self.pool_weights:
            snapshot = snapshot.steered(self.pool_weights, self.drained)
        if features.forced_pool is not None and self.allow_pool_override:
            return Forced(self.model).decide(features, snapshot)
        return self.policy.decide(features, snapshot)
