"""The policy document: what operators change live, validated strictly and compiled into a plan.

A JSON object; every key but `schema_version` is optional and takes the default shown:

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
      }
    }

Unknown keys, wrong types and out-of-range values raise `DocumentError`, whose `field` is the
path of the offending key (`pools.plain.weight`). Shedding and exploration are the adaptive
policy's; the other policies neither shed nor explore, so enabling shedding with them is an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import orjson

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, get_profile
from specgate.policies.latency_model import LatencyModel
from specgate.policies.registry import POLICY_NAMES, PolicyConfigError, RoutingPlan, SloTargets, build_policy

SCHEMA_VERSION = 1
MAX_SLO_MS = 3_600_000.0
MAX_WEIGHT = 100.0
MAX_CLASSES = 256
_TOP_LEVEL = frozenset(
    {"schema_version", "policy", "params", "profile", "slo", "allow_pool_override", "shedding", "exploration", "pools"}
)
_ADAPTIVE_OWN = frozenset({"shed", "shed_below_priority", "retry_after_s", "exploration"})
"""Adaptive parameters the document sets at its top level, never under `params`."""


class DocumentError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Shedding:
    enabled: bool = False
    below_priority: int = 0
    """Requests whose x-priority is below this may be refused with 429."""
    retry_after_s: float = 1.0


@dataclass(frozen=True)
class PoolControl:
    weight: float = 1.0
    drain: bool = False


@dataclass(frozen=True)
class PolicyDocument:
    policy: str = "adaptive"
    params: Mapping[str, Any] = field(default_factory=dict)
    profile: str = DEFAULT_PROFILE
    slo: SloTargets = field(default_factory=SloTargets)
    slo_classes: Mapping[str, SloTargets] = field(default_factory=dict)
    allow_pool_override: bool = True
    shedding: Shedding = field(default_factory=Shedding)
    exploration: float = 0.02
    pools: Mapping[Pool, PoolControl] = field(default_factory=lambda: {pool: PoolControl() for pool in Pool})

    def to_json(self) -> dict[str, Any]:
        def slo(t: SloTargets) -> dict[str, float | None]:
            return {"ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms}

        return {
            "schema_version": SCHEMA_VERSION,
            "policy": self.policy,
            "params": dict(self.params),
            "profile": self.profile,
            "slo": {"default": slo(self.slo), "classes": {k: slo(v) for k, v in self.slo_classes.items()}},
            "allow_pool_override": self.allow_pool_override,
            "shedding": {
                "enabled": self.shedding.enabled,
                "below_priority": self.shedding.below_priority,
                "retry_after_s": self.shedding.retry_after_s,
            },
            "exploration": self.exploration,
            "pools": {p.value: {"weight": c.weight, "drain": c.drain} for p, c in self.pools.items()},
        }

    def dumps(self) -> bytes:
        """Canonical JSON: the same document always gives the same bytes."""
        return orjson.dumps(self.to_json(), option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)

    def compile(self, version: str) -> RoutingPlan:
        model = LatencyModel(get_profile(self.profile))
        params = dict(self.params)
        if self.policy == "adaptive":
            params.update(
                shed=self.shedding.enabled,
                shed_below_priority=self.shedding.below_priority,
                retry_after_s=self.shedding.retry_after_s,
                exploration=self.exploration,
            )
        return RoutingPlan(
            build_policy(self.policy, params, model),
            model,
            allow_pool_override=self.allow_pool_override,
            version=version,
            slo=self.slo,
            slo_classes=self.slo_classes,
            pool_weights={p: c.weight for p, c in self.pools.items() if c.weight != 1.0},
            drained=frozenset(p for p, c in self.pools.items() if c.drain),
        )


def loads(raw: bytes | str) -> PolicyDocument:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DocumentError("(document)", f"not valid JSON: {exc}") from None
    return parse(obj)


def _table(path: str, value: Any, known: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise DocumentError(path or "(document)", f"expected an object, got {_kind(value)}")
    for key in value:
        if key not in known:
            where = f"{path}.{key}" if path else key
            raise DocumentError(where, f"unknown key; known: {', '.join(sorted(known))}")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise DocumentError(path, f"expected true or false, got {_kind(value)}")
    return value


def _number(path: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DocumentError(path, f"expected a number, got {_kind(value)}")
    if not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise DocumentError(path, f"must lie in {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _integer(path: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DocumentError(path, f"expected an integer, got {_kind(value)}")
    if not low <= value <= high:
        raise DocumentError(path, f"must lie in [{low}, {high}], got {value}")
    return value


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise DocumentError(path, f"expected a string, got {_kind(value)}")
    return value


def _slo(path: str, value: Any) -> SloTargets:
    table = _table(path, value, frozenset({"ttft_ms", "tpot_ms"}))
    targets = {}
    for key in ("ttft_ms", "tpot_ms"):
        raw = table.get(key)
        targets[key] = None if raw is None else _number(f"{path}.{key}", raw, 0.0, MAX_SLO_MS, low_open=True)
    return SloTargets(**targets)


def _class_name(path: str, name: str) -> str:
    if not 1 <= len(name) <= 64 or not all(c.isascii() and (c.isalnum() or c in "._-") for c in name):
        raise DocumentError(f"{path}.{name}", "a class name is 1-64 letters, digits and ._-")
    return name


def parse(obj: Any) -> PolicyDocument:
    """Validate a decoded JSON document; the result compiles (its policy and profile exist)."""
    doc = _table("", obj, _TOP_LEVEL)
    if "schema_version" not in doc:
        raise DocumentError("schema_version", "missing; this gateway reads schema_version 1")
    version = doc["schema_version"]
    if isinstance(version, bool) or version != SCHEMA_VERSION:
        raise DocumentError("schema_version", f"unsupported: {version!r}; this gateway reads 1")
    default = PolicyDocument()
    policy = _string("policy", doc.get("policy", default.policy))
    if policy not in POLICY_NAMES:
        raise DocumentError("policy", f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}")
    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise DocumentError("params", f"expected an object, got {_kind(params)}")
    for key in params:
        if policy == "adaptive" and key in _ADAPTIVE_OWN:
            top = "exploration" if key == "exploration" else "shedding"
            raise DocumentError(f"params.{key}", f"set it in the document's {top!r}, not in params")
    profile = _string("profile", doc.get("profile", default.profile))

    slo_table = _table("slo", doc.get("slo", {}), frozenset({"default", "classes"}))
    slo = _slo("slo.default", slo_table["default"]) if "default" in slo_table else SloTargets()
    classes_raw = slo_table.get("classes", {})
    if not isinstance(classes_raw, dict):
        raise DocumentError("slo.classes", f"expected an object, got {_kind(classes_raw)}")
    if len(classes_raw) > MAX_CLASSES:
        raise DocumentError("slo.classes", f"at most {MAX_CLASSES} classes, got {len(classes_raw)}")
    classes = {_class_name("slo.classes", k): _slo(f"slo.classes.{k}", v) for k, v in classes_raw.items()}

    shed_table = _table("shedding", doc.get("shedding", {}), frozenset({"enabled", "below_priority", "retry_after_s"}))
    shedding = Shedding(
        enabled=_bool("shedding.enabled", shed_table.get("enabled", False)),
        below_priority=_integer("shedding.below_priority", shed_table.get("below_priority", 0), -1_000_000, 1_000_000),
        retry_after_s=_number("shedding.retry_after_s", shed_table.get("retry_after_s", 1.0), 0.0, 3600.0),
    )
    if shedding.enabled and policy != "adaptive":
        raise DocumentError("shedding.enabled", f"only the adaptive policy sheds; policy is {policy!r}")

    pools_table = _table("pools", doc.get("pools", {}), frozenset(p.value for p in Pool))
    pools = {}
    for pool in Pool:
        path = f"pools.{pool.value}"
        table = _table(path, pools_table.get(pool.value, {}), frozenset({"weight", "drain"}))
        pools[pool] = PoolControl(
            weight=_number(f"{path}.weight", table.get("weight", 1.0), 0.0, MAX_WEIGHT, low_open=True),
            drain=_bool(f"{path}.drain", table.get("drain", False)),
        )
    if all(c.drain for c in pools.values()):
        raise DocumentError("pools", "both pools drained: the gateway could serve nothing")

    document = PolicyDocument(
        policy=policy,
        params=MappingProxyType(dict(params)),
        profile=profile,
        slo=slo,
        slo_classes=classes,
        allow_pool_override=_bool("allow_pool_override", doc.get("allow_pool_override", True)),
        shedding=shedding,
        exploration=_number("exploration", doc.get("exploration", default.exploration), 0.0, 0.5),
        pools=pools,
    )
    try:
        get_profile(profile)
    except KeyError as exc:
        raise DocumentError("profile", str(exc.args[0]) if exc.args else "unknown profile") from None
    try:
        document.compile("check")
    except PolicyConfigError as exc:
        raise DocumentError(f"params.{exc.param}" if exc.param else "params", str(exc)) from None
    return document
