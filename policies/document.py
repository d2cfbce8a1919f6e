"""The policy document: what operators change live, validated strictly and compiled into a plan.

A JSON object (in the config file, the same object as the TOML table [policy]); every key but
`schema_version` is optional and takes the default shown:

    {
      "schema_version": 1,
      "policy": "adaptive",                      # any name in policies.registry
      "params": {},                              # that policy's parameters
      "profile": "a100-codellama34b-tp2",        # the calibrated profile the latency model starts from
      "slo": {
        "default": {"ttft_ms": null, "tpot_ms": null},   # for requests without SLO headers
        "classes": {"batch": {"ttft_ms": 30000, "tpot_ms": 200}}   # by x-request-class
      },
      "allow_pool_override": true,               # honour x-route-pool
      "shedding": {"enabled": false, "below_priority": 0, "retry_after_s": 1.0},
      "exploration": 0.02,
      "pools": {
        "speculative": {"weight": 1.0, "drain": false},
        "plain": {"weight": 1.0, "drain": false}
      },
      "switching": {"enabled": false, "min_per_pool": 1, "confirmations": 2, "min_gain": 0.01,
                    "sigmas": 0.0, "cooldown_ms": 600000},
      "replicas": {                              # by URL, as the gateways' configs list them
        "http://10.0.0.7:8000": {"pool": "speculative", "drain": false}
      },
      "admission": {"enabled": true, "max_queue": 1000, "max_wait_factor": 3.0,
                    "max_wait_ms": 30000, "refuse_infeasible": true}
    }

Unknown keys, wrong types and out-of-range values raise `DocumentError`, whose `field` is the
path of the offending key (`pools.plain.weight`). Shedding is the adaptive policy's alone; the
other policies never refuse a request, so enabling shedding with them is an error. `parse`
checks everything `compile` relies on, so a parsed document always compiles, once, into the plan
the gateway swaps in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES, Profile
from specgate.policies.admission import Admission
from specgate.policies.decision import Shedding
from specgate.policies.features import SloTargets
from specgate.policies.latency_model import LatencyModel
from specgate.policies.registry import Knobs, RoutingPlan, build_policy, policy_kind, policy_params
from specgate.validation import ClassName, Invalid, Weight, convert

SCHEMA_VERSION = 1
MAX_CLASSES = 256


class DocumentError(Invalid):
    """A policy document that cannot be applied; `field` names the offending key."""


class SloTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    default: SloTargets = SloTargets()
    classes: Mapping[str, SloTargets] = msgspec.field(default_factory=dict)
    """By `x-request-class`; a class not listed gets `default`."""


class PoolControl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    weight: Weight = 1.0
    """Preference for the pool: policies divide its load and predicted completion by it."""
    drain: bool = False
    """Take no new requests (an operator's kill switch)."""


class PoolControls(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    speculative: PoolControl = PoolControl()
    plain: PoolControl = PoolControl()

    def __getitem__(self, pool: Pool) -> PoolControl:
        return self.speculative if pool is Pool.SPECULATIVE else self.plain


class ReplicaControl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One replica, overriding what the gateway's configuration says of it: how `specgate pools
    switch` moves a server between the pools without restarting a gateway."""

    pool: Pool | None = None
    """The pool it serves in now (its server restarted with, or without, speculation); None: the
    one the configuration puts it in."""
    drain: bool = False
    """Take no new requests; those in flight finish (a server about to restart)."""


class Switching(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Whether the live advisor may move servers between the pools on its own (`specgate pools
    switch`, one server at a time), and how sure it must be first."""

    enabled: bool = False
    min_per_pool: Annotated[int, Meta(ge=0, le=1000)] = 1
    """It never leaves a pool with fewer servers than this."""
    confirmations: Annotated[int, Meta(ge=1, le=100)] = 2
    """Plans in a row that must want the same direction before a server moves (hysteresis); then
    the next moves as soon as the last is back while that plan wants more, and while the plans
    after it go on wanting it, one more each cooldown."""
    min_gain: Annotated[float, Meta(ge=0, le=1)] = 0.01
    """The share of good tokens a second (of requests that met their SLOs) the recommended split
    must be predicted to add to the current one's, on the traffic planned on (0.01: 1% more)."""
    sigmas: Annotated[float, Meta(ge=0, le=10)] = 0.0
    """And beyond that, this many standard errors of the gain as the plans' own traffic gives it
    (their stretches' spread), pooled over the plans in a row that want the move: a streak is
    confirmed when their mean gain less `sigmas` standard errors of that mean is at least
    `min_gain`. A plan's splits differ by chance by more than 1% where they are close; 0 (the
    default) trusts each plan's figure as it is (docs/benchmarks.md)."""
    cooldown_ms: Annotated[float, Meta(ge=0, le=86_400_000)] = 600_000.0
    """After a move, how long before a later plan's may start (the moves one plan wants follow one
    another as each server is back)."""


ReplicaUrl = Annotated[str, Meta(pattern=r"^https?://[^\s/]+$", max_length=512)]
"""A replica as the gateways' configurations name it: scheme, host and port, no path."""
MAX_REPLICAS = 4096


class PolicyDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    schema_version: Literal[1] = 1
    policy: str = "adaptive"
    params: Mapping[str, Any] = msgspec.field(default_factory=dict)
    profile: str = DEFAULT_PROFILE
    slo: SloTable = SloTable()
    allow_pool_override: bool = True
    shedding: Shedding = Shedding()
    exploration: Annotated[float, Meta(ge=0, le=0.5)] = 0.02
    """Share of requests the adaptive policy sends to the other pool's best replica, to keep learning it."""
    pools: PoolControls = PoolControls()
    admission: Admission = Admission()
    """How the adaptive policy holds requests no replica can serve in time now."""
    switching: Switching = Switching()
    """Whether the live advisor moves servers between the pools itself."""
    replicas: Mapping[str, ReplicaControl] = msgspec.field(default_factory=dict)
    """Per replica URL: the pool it serves in and whether it is drained. A gateway applies the
    entries of the replicas it routes to and ignores the others (another gateway's fleet)."""

    def replica_pools(self) -> dict[str, Pool]:
        """The replicas, by URL, that serve in a pool the document names."""
        return {url: c.pool for url, c in self.replicas.items() if c.pool is not None}

    def drained_replicas(self) -> frozenset[str]:
        return frozenset(url for url, c in self.replicas.items() if c.drain)

    def with_replica(self, url: str, control: ReplicaControl) -> PolicyDocument:
        """The same document with `url`'s entry replaced (removed when it says nothing)."""
        replicas = {**self.replicas, url: control}
        if control == ReplicaControl():
            del replicas[url]
        return msgspec.structs.replace(self, replicas=replicas)

    def to_json(self) -> dict[str, Any]:
        result: dict[str, Any] = msgspec.to_builtins(self, order="sorted")
        return result

    def dumps(self) -> bytes:
        """Canonical JSON: the same document always gives the same bytes."""
        return msgspec.json.format(msgspec.json.encode(self, order="sorted"), indent=2)

    def compile(self, version: str, profiles: Mapping[str, Profile] = PROFILES) -> RoutingPlan:
        """The plan this document routes by; `parse`, given the same `profiles` (the built-in ones
        and those loaded from files), has checked everything this relies on."""
        model = LatencyModel(profiles[self.profile])
        knobs = Knobs(shedding=self.shedding, exploration=self.exploration, admission=self.admission)
        return RoutingPlan(
            build_policy(self.policy, self.params, model, knobs),
            model,
            allow_pool_override=self.allow_pool_override,
            version=version,
            slo=self.slo.default,
            slo_classes=self.slo.classes,
            pool_weights={p: self.pools[p].weight for p in Pool if self.pools[p].weight != 1.0},
            drained=frozenset(p for p in Pool if self.pools[p].drain),
            admission=self.admission,
        )


def revised(document: PolicyDocument, profiles: Mapping[str, Profile] = PROFILES, **changes: Any) -> PolicyDocument:
    """A copy of `document` with some keys changed, validated like any other document."""
    return parse(msgspec.to_builtins(msgspec.structs.replace(document, **changes)), profiles=profiles)


def loads(raw: bytes | str, profiles: Mapping[str, Profile] = PROFILES) -> PolicyDocument:
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise DocumentError("(document)", f"not valid JSON: {exc}") from None
    return parse(obj, profiles=profiles)


def parse(obj: Any, *, prefix: str = "", profiles: Mapping[str, Profile] = PROFILES) -> PolicyDocument:
    """Validate a decoded JSON document; `prefix` heads the fields errors name (a config file's
    [policy] table is a document too, with `schema_version` optional there)."""
    if isinstance(obj, dict) and "schema_version" not in obj and not prefix:
        raise DocumentError("schema_version", f"missing; this gateway reads schema_version {SCHEMA_VERSION}")
    try:
        _check_classes(obj, prefix)
        _check_replicas(obj, prefix)
        document = convert(obj, PolicyDocument, root=prefix or "(document)", prefix=prefix)
    except Invalid as exc:
        raise DocumentError(exc.field, exc.message) from None
    try:
        _check(document, profiles)
    except Invalid as exc:
        raise DocumentError(f"{prefix}.{exc.field}" if prefix else exc.field, exc.message) from None
    return document


def _check_replicas(obj: Any, prefix: str) -> None:
    """Each replica's entry on its own, so that an error names the replica."""
    replicas = obj.get("replicas") if isinstance(obj, dict) else None
    if isinstance(replicas, dict):
        where = f"{prefix}.replicas" if prefix else "replicas"
        if len(replicas) > MAX_REPLICAS:
            raise Invalid(where, f"at most {MAX_REPLICAS} replicas, got {len(replicas)}")
        for url, control in replicas.items():
            convert(url, ReplicaUrl, root=f"{where}.{url}")
            convert(control, ReplicaControl, root=f"{where}.{url}", prefix=f"{where}.{url}")


def _check_classes(obj: Any, prefix: str) -> None:
    """Each SLO class on its own, so that an error names the class (a table's key is not in
    the path the whole conversion reports)."""
    slo = obj.get("slo") if isinstance(obj, dict) else None
    classes = slo.get("classes") if isinstance(slo, dict) else None
    if isinstance(classes, dict):
        where = f"{prefix}.slo.classes" if prefix else "slo.classes"
        for name, targets in classes.items():
            convert(name, ClassName, root=f"{where}.{name}")
            convert(targets, SloTargets, root=f"{where}.{name}", prefix=f"{where}.{name}")


def _check(document: PolicyDocument, profiles: Mapping[str, Profile]) -> None:
    """What one field's type cannot say: how fields relate, and what the names refer to."""
    kind = policy_kind(document.policy)
    policy_params(document.policy, document.params)
    if document.profile not in profiles:
        raise Invalid("profile", f"unknown profile {document.profile!r}; known: {', '.join(profiles)}")
    if len(document.slo.classes) > MAX_CLASSES:
        raise Invalid("slo.classes", f"at most {MAX_CLASSES} classes, got {len(document.slo.classes)}")
    if document.shedding.enabled and not kind.sheds:
        raise Invalid("shedding.enabled", f"only the adaptive policy sheds; policy is {document.policy!r}")
    if all(document.pools[p].drain for p in Pool):
        raise Invalid("pools", "both pools drained: the gateway could serve nothing")
