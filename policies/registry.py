"""Policies by name, built from declarative parameters, and the routing plan that runs them.

A plan is immutable: the gateway swaps a new one in with one assignment, so a request is always
routed by exactly one complete plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specgate.calibration.modes import Pool
from specgate.policies.adaptive import Adaptive
from specgate.policies.baselines import Forced, LeastLoaded, PoolOnly, RoundRobin, Threshold
from specgate.policies.decision import Decision, Policy, Shed
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.workers.snapshot import Snapshot


class PolicyConfigError(ValueError):
    """A policy name or parameter that cannot be used; the message names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The parameter at fault; None when the policy's name is."""


def _number(name: str, params: Mapping[str, object], key: str, default: float, low: float, high: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise PolicyConfigError(f"policy {name}: {key} must be a number in [{low}, {high}], got {value!r}", key)
    return float(value)


def _adaptive(model: LatencyModel, params: Mapping[str, object]) -> Policy:
    shed = params.get("shed", False)
    if not isinstance(shed, bool):
        raise PolicyConfigError(f"policy adaptive: shed must be true or false, got {shed!r}", "shed")
    below = params.get("shed_below_priority", 0)
    if isinstance(below, bool) or not isinstance(below, int):
        raise PolicyConfigError(
            f"policy adaptive: shed_below_priority must be an integer, got {below!r}", "shed_below_priority"
        )
    return Adaptive(
        model,
        exploration=_number("adaptive", params, "exploration", 0.02, 0.0, 0.5),
        harm_weight=_number("adaptive", params, "harm_weight", 0.5, 0.0, 100.0),
        shed=shed,
        shed_below_priority=below,
        retry_after_s=_number("adaptive", params, "retry_after_s", 1.0, 0.0, 3600.0),
        slo_margin=_number("adaptive", params, "slo_margin", 0.9, 0.1, 0.999),
        min_chance=_number("adaptive", params, "min_chance", 0.5, 0.0, 1.0),
        tolerance=_number("adaptive", params, "tolerance", 0.05, 0.0, 1.0),
    )


def _threshold(model: LatencyModel, params: Mapping[str, object]) -> Policy:
    value = params.get("max_load", 8)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PolicyConfigError(f"policy threshold: max_load must be a positive number, got {value!r}", "max_load")
    return Threshold(model, float(value))


_BUILDERS: Mapping[str, tuple[frozenset[str], Callable[[LatencyModel, Mapping[str, object]], Policy]]] = {
    "adaptive": (
        frozenset(
            {
                "exploration",
                "harm_weight",
                "shed",
                "shed_below_priority",
                "retry_after_s",
                "slo_margin",
                "min_chance",
                "tolerance",
            }
        ),
        _adaptive,
    ),
    "round-robin": (frozenset(), lambda m, _: RoundRobin(m)),
    "least-loaded": (frozenset(), lambda m, _: LeastLoaded(m)),
    "speculative-only": (frozenset(), lambda m, _: PoolOnly(m, Pool.SPECULATIVE)),
    "plain-only": (frozenset(), lambda m, _: PoolOnly(m, Pool.PLAIN)),
    "threshold": (frozenset({"max_load"}), _threshold),
}

POLICY_NAMES = tuple(_BUILDERS)


def build_policy(name: str, params: Mapping[str, object], model: LatencyModel) -> Policy:
    try:
        allowed, build = _BUILDERS[name]
    except KeyError:
        raise PolicyConfigError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}") from None
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise PolicyConfigError(f"policy {name}: unknown parameter(s) {', '.join(unknown)}", unknown[0])
    return build(model, params)


@dataclass(frozen=True)
class SloTargets:
    """The SLOs a request gets when it sends no header of its own."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


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

    def slo_for(self, request_class: str) -> SloTargets:
        return self.slo_classes.get(request_class, self.slo)

    def decide(self, features: RequestFeatures, snapshot: Snapshot) -> Decision | Shed | None:
        if self.drained or self.pool_weights:
            snapshot = snapshot.steered(self.pool_weights, self.drained)
        if features.forced_pool is not None and self.allow_pool_override:
            return Forced(self.model).decide(features, snapshot)
        return self.policy.decide(features, snapshot)
